"""Reading a tritonserver crash from its output: the stack it printed, the function that faulted, and whether it is
the bundled Triton 2.51's known gRPC-frontend race (docs/server.md, "A known crash in Triton 2.51";
triton_workarounds.GRPC_CANCEL_RACE).

``make serve`` names the site when it restarts a crashed server, the soak reports it, and the tests that cancel many
gRPC streams start a fresh server and run again when (and only when) the crash is that known one.
"""

from __future__ import annotations

import re
import subprocess

# Triton's signal handler prints "Signal (11) received." and then one line per frame: " 2# 0x55FB1AF4E97E in .../bin/
# tritonserver". Only the addresses are printed, but the bundled binary keeps its symbols.
FRAME = re.compile(r"^\s*(\d+)# 0x([0-9A-Fa-f]+) in (\S+/bin/tritonserver)$")
SIGNAL_LINE = re.compile(r"^Signal \((\d+)\) received\.")
# Where the known race faults: Triton's gRPC handlers and the gRPC library under them.
KNOWN_FRONTEND_CRASH = ("triton::server::grpc::", "grpc_core::", "grpc::")


def crash_lines(lines: list[str], count: int = 12) -> list[str]:
    """The last ``count`` lines from the last "Signal (N) received." on (the crash and its stack), or the last
    ``count`` lines when there is none."""
    lines = [line for line in lines if "NVML" not in line]  # the container-less machine's one noisy line
    signal = max((i for i, line in enumerate(lines) if SIGNAL_LINE.match(line)), default=None)
    return lines[signal : signal + count] if signal is not None else lines[-count:]


def crash_site(lines: list[str]) -> str | None:
    """The tritonserver function that crashed, from the raw addresses of a "Signal (N) received." stack.

    Frame 0 lies in the binary's ErrorSignalHandler, which gives the load address; the next tritonserver frame after
    libc's signal trampoline is where the fault happened. None when the stack or the tools (nm, addr2line) are not
    there.
    """
    frames = [(int(m[1]), int(m[2], 16), m[3]) for m in map(FRAME.match, lines) if m]
    if len(frames) < 2 or frames[0][0] != 0:
        return None
    binary = frames[0][2]
    try:
        symbols = subprocess.run(["nm", "-C", binary], capture_output=True, text=True, timeout=60).stdout
        handler = next(
            int(line.split()[0], 16) for line in symbols.splitlines() if line.endswith("::ErrorSignalHandler(int)")
        )
        base = (frames[0][1] - handler) & ~0xFFF
        where = subprocess.run(
            ["addr2line", "-f", "-C", "-e", binary, hex(frames[1][1] - base)],
            capture_output=True, text=True, timeout=60,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError, StopIteration, ValueError):
        return None
    return where[0] if where and where[0] != "??" else None


def is_known_frontend_crash(site: str | None) -> bool:
    """Whether a crash site (``crash_site``) is in the known gRPC-frontend race."""
    return site is not None and site.startswith(KNOWN_FRONTEND_CRASH)


def known_frontend_crash(lines: list[str]) -> str | None:
    """The crash site when the output ends in the known gRPC-frontend crash; None for any other ending."""
    site = crash_site(crash_lines(lines))
    return site if is_known_frontend_crash(site) else None
