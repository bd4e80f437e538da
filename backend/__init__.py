"""The engine: paged KV cache, continuous/static scheduler, Llama forward over the paged cache, sampler."""

import os

# NOTE: OpenMP threads that spin while waiting (libgomp's default) starve each other on a machine where the server,
# the load generator and the engine share few cores: a decode step measured 2.2 s instead of 36 ms on 2 busy cores
# when the engine ran on a process's main thread. Sleeping waits cost little per step. This must be set before
# torch loads its OpenMP runtime, which is why it lives here, first in the package; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
