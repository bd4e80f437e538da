"""The engine gives the same tokens whichever thread loads and steps it, under the OpenMP settings that
``backend.engine.openmp`` sets (a bounded spin, loops shared out dynamically), under sleeping waits and under a
static split of the loops: threading changes speed (``make bench`` and ``bench.omp_schedule`` measure it), never
tokens. Each setting runs in its own process, since OpenMP reads it once, when torch loads.
Importing ``backend`` itself sets nothing (the launcher and Locust keep libgomp's defaults)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from backend.engine import openmp

SCRIPT = r"""
import json, os, sys, threading

VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_SCHEDULE")

from backend.engine.openmp import run_schedule, set_wait_policy

set_wait_policy()  # before torch loads, as every process that builds an engine does
from backend.engine.config import EngineConfig
from backend.engine.sampling_params import SamplingParams
from backend.engine.llm_engine import LLMEngine
from backend.engine.batching import EngineLoop

PROMPTS = ["The history of the printing press begins", "def fibonacci(n):", "Paris is the capital of"]
PARAMS = [
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.8, top_k=40, seed=8, ignore_eos=True),
]


def make_engine():
    return LLMEngine(EngineConfig(model=sys.argv[1], dtype="bfloat16", num_threads=2, max_num_seqs=4,
                                  max_model_len=256, num_kv_blocks=64))


def generate(engine):
    return [output.token_ids for output in engine.generate(PROMPTS, PARAMS)]


tokens = {"loaded and run on the main thread": generate(make_engine())}
engine, box = make_engine(), {}
thread = threading.Thread(target=lambda: box.update(tokens=generate(engine)))
thread.start()
thread.join()
tokens["loaded on the main thread, run on another"] = box["tokens"]
loop = EngineLoop.build(make_engine)  # as llm_continuous serves: loaded and stepped on the loop's thread
streams = [loop.submit(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS))]
tokens["loaded and stepped on the engine loop's thread"] = [
    [t for out in s for t in out.new_token_ids] for s in streams]
loop.shutdown()
settings = {name: os.environ.get(name) for name in VARIABLES}
print(json.dumps({"settings": settings, "schedule": run_schedule(), "tokens": tokens}))
"""


VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_SCHEDULE")


def run_engines(model_dir, **settings) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir)], env={**env, **settings},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.smollm2
def test_same_tokens_on_every_thread_spinning_or_sleeping_static_or_dynamic(smollm2_dir):
    spinning = run_engines(smollm2_dir)
    assert spinning["settings"] == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": str(openmp.OPENMP_SPIN_COUNT),
                                    "OMP_SCHEDULE": openmp.OPENMP_SCHEDULE}
    assert spinning["schedule"] == ["dynamic", 1]  # what the runtime read, not only what was set
    sleeping = run_engines(smollm2_dir, OMP_WAIT_POLICY="PASSIVE")
    assert sleeping["settings"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None,
                                    "OMP_SCHEDULE": openmp.OPENMP_SCHEDULE}
    static = run_engines(smollm2_dir, OMP_SCHEDULE="static")  # the environment's schedule wins
    assert static["settings"]["OMP_SCHEDULE"] == "static" and static["schedule"][0] == "static"
    reference = spinning["tokens"]["loaded and run on the main thread"]
    assert len(set(map(tuple, reference))) == 3 and all(len(t) == 16 for t in reference)
    for result in (spinning, sleeping, static):
        for where, tokens in result["tokens"].items():
            assert tokens == reference, (result["settings"], where)


def test_importing_backend_sets_no_openmp_variable():
    """Only a process that builds an engine sets the wait policy: importing the packages (the glue and the launcher
    among them) leaves the environment as it was."""
    script = ("import json, os, backend, backend.engine.llm_engine, backend.triton.launcher.serve, "
              "backend.triton.stub.responses; "
              f"print(json.dumps([os.environ.get(name) for name in {VARIABLES!r}]))")
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [None, None, None]
