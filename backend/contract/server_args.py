"""tritonserver's command line, read alike by the launcher (of the server it started: its ports, flags and exit
timeout), the models (of their parent process: how long to drain after a shutdown signal) and the deployment checks.
The drain grace is the fact they share: the stop waits for the models that long, and the models end what is still
running when it is over, before tritonserver's own exit timeout runs out.

NOTE: standard library only (the package's rule, ``backend/contract/__init__.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# tritonserver's default --exit-timeout-secs, and how long before it the models end what is still running: the
# final responses, the connections closing and the models unloading must all fit in this margin.
TRITON_EXIT_TIMEOUT_S = 30.0
SHUTDOWN_MARGIN_S = 5.0


def command_line(pid: int) -> list[str]:
    """The command line of process ``pid`` ([] once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def option_value(args: Sequence[str], name: str) -> str | None:
    """Last value of ``--name X`` or ``--name=X`` in a tritonserver argument list (the server keeps the last)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def exit_timeout(args: Sequence[str]) -> float:
    value = option_value(args, "--exit-timeout-secs")
    try:
        return float(value) if value is not None else TRITON_EXIT_TIMEOUT_S
    except ValueError:
        return TRITON_EXIT_TIMEOUT_S


def drain_grace(args: Sequence[str]) -> float:
    """Seconds the models keep serving what they accepted after the signal: the exit timeout less a margin."""
    return max(0.0, exit_timeout(args) - SHUTDOWN_MARGIN_S)
