"""tritonserver's processes as Linux shows them in /proc: its command line, its children (the Python-backend stubs and
the models they serve), their CPU time, its process group, and the stubs' shared memory; and ``ChildProcess``, the
``with`` block shared by the launchers of tritonserver and of the frontend.

Standard library only (``psutil`` is imported inside the two functions that need it): ``shutdown.py`` imports this
module when it runs as a file in a container, and the launcher runs in the Python 3.10 test environment too.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from backend.contract.server_args import command_line

STUB_NAME = "triton_python_backend_stub"
_SHM_REGION = re.compile(r"triton_python_backend_shm_region_[0-9a-f-]+")
_ENDED = ("Z", "X")  # zombie, dead
_Child = TypeVar("_Child", bound="ChildProcess")


class ChildProcess:
    """``with child:`` starts it (unless it is started), waits until it is ready (and stops it if that fails or is
    interrupted), and always stops it at the end. For a launcher with ``pid`` (None until started), ``start()``,
    ``wait_ready()`` and ``stop()``."""

    def __enter__(self: _Child) -> _Child:
        if self.pid is None:
            self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _stats() -> Iterator[tuple[int, list[str]]]:
    """``(pid, fields)`` of every process; the fields follow "pid (comm)": state, ppid, pgrp, ..."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        yield int(stat.parent.name), fields


def children(pid: int) -> list[int]:
    """Live child processes of ``pid`` (tritonserver's: its Python-backend stubs)."""
    return [child for child, fields in _stats() if int(fields[1]) == pid and fields[0] not in _ENDED]


def process_group_members(pgid: int) -> list[int]:
    """Live processes (zombies left out) whose process group is ``pgid``."""
    return [member for member, fields in _stats() if int(fields[2]) == pgid and fields[0] not in _ENDED]


def is_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in _ENDED


def process_state(pid: int) -> str | None:
    """Process ``pid``'s state letter as /proc shows it ("R" running, "S" asleep, "T" stopped, ...); None once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def cpu_seconds(pid: int) -> float | None:
    """CPU time process ``pid`` has used so far, all its threads, user and system; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def stub_models(pid: int) -> dict[int, str]:
    """``stub pid -> model`` for the live Python-backend stubs of tritonserver ``pid`` (the model folder that holds
    the ``model.py`` a stub runs)."""
    models = {}
    for child in children(pid):
        argv = command_line(child)
        script = next((part for part in argv if part.endswith("model.py")), None)
        if argv and argv[0].endswith(STUB_NAME) and script is not None:
            models[child] = Path(script).parent.parent.name
    return models


def _stub_shm_regions(pids: Iterable[int]) -> list[str]:
    """Shared-memory regions of the Python-backend stubs among ``pids`` (each stub's third argument names it)."""
    regions = []
    for pid in pids:
        argv = command_line(pid)
        if len(argv) > 2 and argv[0].endswith(STUB_NAME) and _SHM_REGION.fullmatch(argv[2]):
            regions.append(argv[2])
    return regions


def kill_process_group(pgid: int, timeout: float = 5.0) -> None:
    """SIGKILL every process in group ``pgid``, wait until none is left, then remove the shared memory of the
    stubs among them (killed processes cannot remove it themselves)."""
    regions = _stub_shm_regions(process_group_members(pgid))
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while process_group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for region in regions:
        try:
            os.unlink(f"/dev/shm/{region}")
        except FileNotFoundError:  # the stub removed it before the signal
            pass


# ---- with psutil (the launcher's callers: tests, the soak, the served benchmark) -------------------------------


def _process_tree(pid: int) -> list:
    import psutil  # NOTE: here, not at the top: the Python 3.10 test environment and the container have no psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss(pid: int) -> dict[int, int]:
    """Resident bytes of a process and all its descendants (tritonserver and its Python-backend stubs)."""
    import psutil

    out = {}
    for proc in _process_tree(pid):
        try:
            out[proc.pid] = proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            pass
    return out


def process_names(pid: int) -> dict[int, str]:
    """``pid -> what it is`` for a process and its descendants: "tritonserver", or the model a stub serves."""
    import psutil

    names = {}
    for proc in _process_tree(pid):
        try:
            cmdline = proc.cmdline()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        stub = next((part for part in cmdline if part.endswith("model.py")), None)
        names[proc.pid] = Path(stub).parent.parent.name if stub else Path(cmdline[0]).name if cmdline else "?"
    return names
