"""The engine loop (backend/engine/batching.py) without a server: a bounded queue, and exactly one final output for
every request, whatever fails.
"""

from __future__ import annotations

import threading
import time

import pytest

from backend.contract import errors
from backend.contract.errors import ErrorKind


def kind_of(message: str) -> ErrorKind | None:
    parsed = errors.parse(message)
    return None if parsed is None else parsed.kind


@pytest.fixture(scope="module")
def tiny_engine_config(tiny_llama_dir):
    return dict(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_seqs=4)


def run_loop(config: dict, fault_hook=None):
    from backend.engine.batching import EngineLoop
    from backend.engine.config import EngineConfig
    from backend.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(**config))
    engine.fault_hook = fault_hook
    finals: dict[str, list] = {}
    lock = threading.Lock()

    def sink(output):
        if output.finished:
            with lock:
                finals.setdefault(output.request_id, []).append(output)

    loop = EngineLoop(engine, sink=sink)
    loop.start()
    return engine, loop, finals


@pytest.mark.timeout(120)
def test_the_loop_bounds_its_queue_and_every_request_gets_exactly_one_final_output(tiny_engine_config):
    from backend.engine.batching import SHUTTING_DOWN, EngineOverloaded, EngineUnavailable
    from backend.engine.sampling_params import SamplingParams

    # NOTE: the first step waits until the 40 have gone in: a submitter held back on a loaded machine would otherwise
    # see requests finish and free seats meanwhile. The requests that step took (at most 4 seats) left the queue.
    submitted = threading.Event()
    engine, loop, finals = run_loop({**tiny_engine_config, "max_queue_size": 8},
                                    fault_hook=lambda requests: submitted.wait(60))
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    accepted, overloaded = [], 0
    for i in range(40):
        try:
            loop.submit(f"r{i}", f"request {i}", params)
            accepted.append(f"r{i}")
        except EngineOverloaded as exc:
            overloaded += 1
            assert kind_of(str(exc)) is ErrorKind.OVERLOADED and "max_queue_size=8" in str(exc)
    submitted.set()
    assert 8 <= len(accepted) <= 8 + 4 and overloaded == 40 - len(accepted)
    loop.abort(accepted[0])
    loop.drain(0.5)  # refuse from now on; what is left after 0.5 s ends with SHUTTING_DOWN
    with pytest.raises(EngineUnavailable) as refused:
        loop.submit("late", "too late", params)
    assert str(refused.value) == SHUTTING_DOWN
    deadline = time.monotonic() + 30
    while len(finals) < len(accepted) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(finals) == sorted(accepted) and all(len(outputs) == 1 for outputs in finals.values())
    assert finals[accepted[0]][0].finish_reason == "abort"
    assert any(o[0].error == SHUTTING_DOWN for o in finals.values())
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()


@pytest.mark.timeout(120)
def test_a_fatal_engine_error_gives_every_open_request_a_final_error(tiny_engine_config):
    from backend.engine.batching import EngineUnavailable
    from backend.engine.sampling_params import SamplingParams
    from backend.triton.stub.faults import FaultInjector

    faults = FaultInjector({"fatal_error": "<<boom>>"})
    engine, loop, finals = run_loop(tiny_engine_config, fault_hook=faults)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    for i in range(6):  # more than max_num_seqs: some are still waiting when the engine breaks
        loop.submit(f"r{i}", f"request {i}", params)
    time.sleep(0.2)
    faults.watch("boom", "<<boom>>")
    loop.submit("boom", "<<boom>>", params)
    deadline = time.monotonic() + 30
    while len(finals) < 7 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(finals) == sorted([f"r{i}" for i in range(6)] + ["boom"])
    failed = [o[0] for o in finals.values() if o[0].error]
    assert failed and all(kind_of(o.error) is ErrorKind.ENGINE_FAILED for o in failed)
    assert not loop.is_alive
    with pytest.raises(EngineUnavailable, match="restart the server") as refused:
        loop.submit("after", "hello", params)
    assert kind_of(str(refused.value)) is ErrorKind.ENGINE_FAILED
