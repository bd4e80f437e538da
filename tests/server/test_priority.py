"""Request priorities on a real server: with one seat, a request of the highest level sent after low-level ones that
are already queued gets its first token before them, on every model: Triton's dynamic batcher orders llm_dynamic's
and llm_static's queue, the engine's scheduler (``scheduling_policy: priority``) llm_continuous's and
llm_iterative's (whose Triton batcher hands over more candidates than the engine has seats). The request that holds
the seat takes a slow first step (the test-only ``slow_step`` fault, 1 s), in which the others arrive."""

from __future__ import annotations

import json
import time

import pytest

from backend.contract import names
from backend.contract.priority import BATCH, INTERACTIVE
from backend.contract.prometheus import parse_prometheus, scrape
from backend.contract.settings import FAULTS_ENV_VAR
from backend.triton.launcher import config_text
from client.grpc_stream import start_stream
from tests.server_harness import make_repository

GREEDY = {"temperature": 0.0, "ignore_eos": True}
SLOW_STEP = "<<take-your-time>>"


@pytest.fixture(scope="module")
def one_seat_server(triton_server_factory, tiny_llama_dir, tmp_path_factory):
    """Every model with one seat (max_num_seqs 1; Triton's batches of one for llm_dynamic and llm_static)."""
    settings = {"max_num_seqs": "1", "fault_injection": json.dumps({"slow_step": SLOW_STEP})}
    repo = make_repository(tmp_path_factory.mktemp("repo") / "model_repository", settings, models=names.MODELS)
    for model in (names.DYNAMIC, names.STATIC):
        with config_text.edit(repo / model / "config.pbtxt") as config:
            config_text.set_max_batch_size(config, 1)
            del config_text.dynamic_batching(config).preferred_batch_size[:]
    return triton_server_factory.start(repo, model=tiny_llama_dir, env={FAULTS_ENV_VAR: "1"})


@pytest.mark.parametrize("model", names.MODELS)
def test_a_high_priority_request_is_admitted_ahead_of_queued_low_priority_ones(one_seat_server, model):
    url = one_seat_server.grpc_url
    blocker = start_stream(url, model, f"the batch job that holds the seat {SLOW_STEP}", max_tokens=16,
                           priority=BATCH, **GREEDY)
    streams = [blocker]
    try:
        time.sleep(0.2)  # it holds the seat, in its slow first step
        queued = [start_stream(url, model, f"batch job {i}", max_tokens=4, priority=BATCH, **GREEDY) for i in range(2)]
        streams += queued
        time.sleep(0.2)  # they wait, in Triton's queue or the engine's
        assert not blocker.chunks, "the seat was freed before the high-priority request came"
        urgent = start_stream(url, model, "an interactive request", max_tokens=4, priority=INTERACTIVE, **GREEDY)
        streams.append(urgent)
        for stream in streams:
            assert stream.wait(timeout=120) and stream.error is None, stream.error
        first_token = urgent.arrival_times[0]
        assert all(first_token < stream.arrival_times[0] for stream in queued), \
            [urgent.arrival_times[0] - s.arrival_times[0] for s in queued]
    finally:
        for stream in streams:
            stream.close(cancel=True)
    # Each level's requests are counted under their own label, beside the unlabelled series.
    series = parse_prometheus(scrape(one_seat_server.metrics_url))
    counted = {s.labels.get("priority") for s in series if s.labels.get("model") == model
               and s.name == f"{names.TIME_TO_FIRST_TOKEN_BY_PRIORITY}_count" and s.value > 0}
    assert {str(INTERACTIVE), str(BATCH)} <= counted
