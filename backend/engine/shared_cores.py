"""Engines that share the machine's cores: each forward runs on the threads its engine may take while others step.

Every Triton model instance is its own process with its own engine and its own OpenMP team, whose threads spin
between a step's parallel regions (``backend/engine/openmp.py``). Two such teams on the same cores spin against
each other: on 2 cores a step beside another busy engine took 4.7x its time alone. Engines that share a
:class:`CoreRegistry` (a small file that every process of one server maps) see each other instead:

* ``divide`` (the default): before each forward an engine counts the engines busy now (itself included) and steps
  on its share of the cores, ``threads // busy`` (at least 1). Alone it keeps every thread and today's speed; beside
  others, one thread per core has nothing to spin against.
* ``step_lock``: one forward at a time; a forward runs on every thread while the other engines wait in the kernel.
* ``off``: every engine takes every thread, whoever else steps (as before the registry).

``docs/engine-performance.md`` ("Engines that share the cores") has the candidates and why ``divide`` was kept;
``make bench-shared`` measures them side by side.

NOTE: a crashed engine must not hold the others back. Nothing here waits on another process's memory: a slot says
"busy" only until its deadline (:data:`BUSY_WINDOW_S` after a forward; :data:`MAX_FORWARD_S` into one), and the
file's locks are ``flock`` locks, which the kernel drops when their holder dies. A pthread mutex in shared memory
would stay locked. Pure Python: importing this module loads nothing else.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from backend.contract.settings import SHARED_CORES_ENV_VAR

CoreSharing = Literal["divide", "step_lock", "off"]
CORE_SHARING = ("divide", "step_lock", "off")


# An engine counts as busy this long after a forward: it covers the Python, IPC and Triton queueing between two
# steps of a loaded engine (a few ms), so a busy engine does not look idle between its steps.
BUSY_WINDOW_S = 0.1
# A forward running longer than this (a long prefill) stops counting as busy: the bound on how long an engine that
# died inside a forward is still counted.
MAX_FORWARD_S = 2.0

MAX_ENGINES = 64
_SLOT = struct.Struct("=qd")  # owner pid (0: free), busy until (time.monotonic(), the same clock in every process)


def cores_available() -> int:
    """The cores this process may run on (its affinity mask, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def share_of(threads: int, busy: int) -> int:
    """Threads for one of ``busy`` engines stepping at once when each alone would take ``threads``."""
    return max(1, threads // max(busy, 1))


class CoreRegistry:
    """One slot per engine in a file mapped by every process that shares the cores: its owner's pid and the time
    until which it counts as busy. A slot whose owner died is taken again by the next engine to register."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with _flocked(fd):  # NOTE: the first engine sizes the file; the others must not see it half made
                if os.fstat(fd).st_size < MAX_ENGINES * _SLOT.size:
                    os.ftruncate(fd, MAX_ENGINES * _SLOT.size)
            self._map = mmap.mmap(fd, MAX_ENGINES * _SLOT.size)
        finally:
            os.close(fd)
        self._lock_path = _step_lock_path(self.path)

    def register(self) -> int:
        """A free slot (never used, released, or left by a process that died), now owned by this process."""
        fd = os.open(self.path, os.O_RDWR)
        try:
            with _flocked(fd):
                for slot in range(MAX_ENGINES):
                    pid, _ = _SLOT.unpack_from(self._map, slot * _SLOT.size)
                    if pid == 0 or not _alive(pid):
                        _SLOT.pack_into(self._map, slot * _SLOT.size, os.getpid(), 0.0)
                        return slot
        finally:
            os.close(fd)
        raise ValueError(f"more than {MAX_ENGINES} engines share the cores through {self.path}")

    def release(self, slot: int) -> None:
        _SLOT.pack_into(self._map, slot * _SLOT.size, 0, 0.0)

    def mark_busy(self, slot: int, until: float) -> None:
        # NOTE: the pid is unchanged and the deadline an aligned 8-byte store: a reader sees the old or the new one.
        _SLOT.pack_into(self._map, slot * _SLOT.size, os.getpid(), until)

    def num_busy(self, now: float) -> int:
        return sum(1 for slot in range(MAX_ENGINES) if _SLOT.unpack_from(self._map, slot * _SLOT.size)[1] > now)

    def step_lock_fd(self) -> int:
        """A descriptor of its own for the step lock (``flock`` locks belong to an open file, so two engines of one
        process exclude each other too)."""
        return os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)


class SharedCores:
    """What one engine does around each forward: ``with cores.forward() as threads:`` run the forward on
    ``threads``. Built once per engine (:meth:`for_engine`); only the thread that steps the engine uses it."""

    def __init__(self, threads: int, sharing: CoreSharing = "divide", registry: CoreRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threads = threads
        self.sharing: CoreSharing = sharing if registry is not None else "off"
        self.registry = registry = registry if self.sharing != "off" else None
        self._clock = clock
        self._slot = registry.register() if registry is not None else None
        self._lock_fd = registry.step_lock_fd() if registry is not None and sharing == "step_lock" else None
        self.last_busy = 1  # engines busy at the last forward, this one included (metrics)

    @classmethod
    def for_engine(cls, threads: int, sharing: CoreSharing) -> SharedCores:
        """The registry named by ``$LLM_SHARED_CORES`` (a Triton server's engines), else an engine alone."""
        path = os.environ.get(SHARED_CORES_ENV_VAR)
        return cls(threads, sharing, CoreRegistry(path) if path and sharing != "off" else None)

    @contextlib.contextmanager
    def forward(self) -> Iterator[int]:
        """Around one forward: yields the threads to run it on, and counts this engine busy while it runs and for
        :data:`BUSY_WINDOW_S` after."""
        if self.registry is None:
            yield self.threads
            return
        now = self._clock()
        self.registry.mark_busy(self._slot, now + MAX_FORWARD_S)
        self.last_busy = self.registry.num_busy(now)
        try:
            if self.sharing == "step_lock":
                with _flocked(self._lock_fd):
                    yield self.threads
            else:
                yield share_of(self.threads, self.last_busy)
        finally:
            self.registry.mark_busy(self._slot, self._clock() + BUSY_WINDOW_S)

    def close(self) -> None:
        if self.registry is not None and self._slot is not None:
            self.registry.release(self._slot)
            self._slot = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def remove_registry(path: str | os.PathLike) -> None:
    """Remove a registry's files (its server has stopped; engines that still map it keep their mapping)."""
    Path(path).unlink(missing_ok=True)
    _step_lock_path(Path(path)).unlink(missing_ok=True)


def _step_lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".step")


@contextlib.contextmanager
def _flocked(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
