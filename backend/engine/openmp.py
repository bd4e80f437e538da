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
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

OPENMP_SPIN_COUNT = 10000
_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def set_wait_policy() -> None:
    """Spin a bounded count between parallel regions in this process (and the processes it starts), unless the
    environment already sets a wait policy or spin count. Call it before torch is imported."""
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
