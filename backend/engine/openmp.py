"""How the engine's OpenMP threads wait between parallel regions: a bounded spin, set by the process that builds an
engine before torch loads its OpenMP runtime.

NOTE: a decode step runs about 240 short parallel regions. Threads that sleep between them (``PASSIVE``) are woken
for each one, a large share of a small step; threads that spin for ever (``ACTIVE`` alone) starve the server and the
load generator on busy cores. So they spin for a bounded count (``GOMP_SPINCOUNT`` counts PAUSE loops, about 0.14 ms
here): long enough to bridge the Python between two regions of a step, short enough that they sleep between steps.
Spinning pays only with one OpenMP team per process (libgomp cuts the spin short once it manages more threads than
there are cores), hence ``EngineLoop.build``. Engines of one server that step at once divide the cores among them
(``backend/engine/shared_cores.py``), so no two teams spin against each other. Where another CPU-bound process
shares the cores, set ``OMP_WAIT_POLICY=PASSIVE``: a wait policy or spin count in the environment wins. Why:
``docs/cpu-kernels.md``.

libgomp reads these variables once, when it is loaded, which is when torch is first imported. So the processes that
build an engine (each Triton model's ``model.py``, ``make bench``, the tests) call :func:`set_wait_policy` before
anything imports torch; importing ``backend`` sets nothing, so the launcher and the load generator keep libgomp's
defaults. Pure Python: importing this module loads nothing else.

It also sets how the projections' and the decode attention's loops share out their work (OpenMP's run schedule,
which their ``schedule(runtime)`` reads): ``dynamic,1``, each thread taking the next panel when it finishes one. In
a server the frontend and tritonserver take a core now and then; with a fixed half each (``static``), the thread
that kept its core waited at the barrier for the other's whole half. ``python -m bench.omp_schedule`` measures the two.
libgomp's own default is ``dynamic,1`` already; it is set because other OpenMP runtimes default to ``static``.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

OPENMP_SPIN_COUNT = 10000
OPENMP_SCHEDULE = "dynamic,1"
_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def set_wait_policy() -> None:
    """Spin a bounded count between parallel regions in this process (and the processes it starts), unless the
    environment already sets a wait policy or spin count; and share the loops out dynamically, unless it sets
    ``OMP_SCHEDULE``. Call it before torch is imported."""
    os.environ.setdefault("OMP_SCHEDULE", OPENMP_SCHEDULE)
    if any(name in os.environ for name in _VARIABLES):
        return
    if "torch" in sys.modules:
        log.warning("OpenMP's wait policy set after torch was imported: this process keeps libgomp's defaults")
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)


def check_wait_policy() -> None:
    """Warn, where an engine is built, when this process left the wait policy to libgomp's defaults."""
    if not any(name in os.environ for name in _VARIABLES):
        log.warning("OpenMP threads use libgomp's default wait policy (slower steps): call "
                    "backend.engine.openmp.set_wait_policy() before torch is imported, as the Triton models do")


# omp_sched_t, less the monotonic flag (the high bit) that the runtime may add
_SCHEDULE_KINDS = {"static": 1, "dynamic": 2, "guided": 3, "auto": 4}


def _runtime():
    """The OpenMP runtime loaded in this process (torch's, which the C kernels run on), or None (Linux only: found
    in /proc/self/maps)."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line})
    except OSError:
        return None
    for path in paths:
        runtime = ctypes.CDLL(path)
        if hasattr(runtime, "omp_set_schedule"):
            return runtime
    return None


def run_schedule() -> tuple[str, int] | None:
    """The run schedule (kind, chunk) of the parallel regions this thread starts, as the loaded runtime reports it;
    None where no runtime is loaded yet."""
    import ctypes

    runtime = _runtime()
    if runtime is None:
        return None
    kind, chunk = ctypes.c_int(), ctypes.c_int()
    runtime.omp_get_schedule(ctypes.byref(kind), ctypes.byref(chunk))
    names = {value: name for name, value in _SCHEDULE_KINDS.items()}
    return names.get(kind.value & 0x7FFFFFFF, str(kind.value)), chunk.value


def set_run_schedule(kind: str, chunk: int = 0) -> None:
    """The run schedule of the parallel regions this thread starts from now on (``bench.omp_schedule`` sets each arm
    before its step); chunk 0 is the kind's default."""
    runtime = _runtime()
    if runtime is None:
        raise RuntimeError("no OpenMP runtime is loaded in this process: import torch first")
    runtime.omp_set_schedule(_SCHEDULE_KINDS[kind], chunk)
