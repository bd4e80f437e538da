"""The engine: paged KV cache, continuous/static scheduler, Llama forward over the paged cache, sampler."""

import os

# NOTE: how OpenMP threads wait between parallel regions decides a decode step's speed on a small machine. A step runs
# about 240 short regions; threads that sleep between them (PASSIVE) are woken for each one, which cost 20 ms of a
# 50 ms served step at batch 1 on 2 cores. Threads that spin for ever (ACTIVE alone: libgomp spins 5 minutes) starved
# the server and the load generator on 2 busy cores (2.2 s steps). So threads spin for a bounded count, about 0.14 ms
# (GOMP_SPINCOUNT counts PAUSE loops, ~14 ns each on the Xeon measured): long enough to bridge the Python between two
# regions of a step (median 50 us), short enough that they sleep between steps. Spinning only pays with one OpenMP
# team per process: libgomp cuts the spin to almost nothing once it manages more threads than there are cores, so
# the engine is loaded on the thread that steps it (EngineLoop.build). Where a CPU-bound process shares the cores,
# spinning threads lose the scheduler's preference for threads that wake from sleep and a step is 2-3x slower than
# with PASSIVE (make bench's served column): set OMP_WAIT_POLICY=PASSIVE there.
# This must be set before torch loads its OpenMP runtime, which is why it lives here, first in the package; a wait
# policy or spin count set in the environment wins.
OPENMP_SPIN_COUNT = 10000
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)
