"""Request priorities on a real server: with one seat, a request of the highest level sent after low-level ones that
are already queued gets its first token before them, on every model: Triton's dynamic batcher orders llm_dynamic's
and llm_static's queue, the engine's scheduler (``scheduling_policy: priority``) llm_continuous's and
llm_iterative's (whose Triton batcher hands over more candidates than the engine has seats). The request that holds
the seat is held in its first step (the test-only ``held_step`` fault) until the others have arrived: the test reads
their arrival from Triton's metrics, so a loaded machine can slow it down but not reorder it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from backend.contract import names
from backend.contract.priority import BATCH, INTERACTIVE
from backend.contract.prometheus import parse_prometheus, scrape
from backend.contract.settings import FAULTS_ENV_VAR, FAULTS_RELEASE_ENV_VAR
from backend.triton.launcher import config_text
from client.grpc_stream import start_stream
from tests.server_harness import make_repository

GREEDY = {"temperature": 0.0, "ignore_eos": True}
HOLD = "<<hold-the-seat>>"
WAIT_S = 120  # for an event on a loaded machine


@pytest.fixture(scope="module")
def release_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hold") / "release"


@pytest.fixture(scope="module")
def one_seat_server(triton_server_factory, tiny_llama_dir, tmp_path_factory, release_file):
    """Every model with one seat (max_num_seqs 1; Triton's batches of one for llm_dynamic and llm_static)."""
    settings = {"max_num_seqs": "1", "fault_injection": json.dumps({"held_step": HOLD})}
    repo = make_repository(tmp_path_factory.mktemp("repo") / "model_repository", settings, models=names.MODELS)
    for model in (names.DYNAMIC, names.STATIC):
        with config_text.edit(repo / model / "config.pbtxt") as config:
            config_text.set_max_batch_size(config, 1)
            del config_text.dynamic_batching(config).preferred_batch_size[:]
    env = {FAULTS_ENV_VAR: "1", FAULTS_RELEASE_ENV_VAR: str(release_file)}
    return triton_server_factory.start(repo, model=tiny_llama_dir, env=env)


def arrived(server, model: str) -> float:
    """Requests that reached the model: those waiting in Triton's queue (llm_dynamic, llm_static and llm_iterative,
    whose execute() the held step blocks) plus those handed to execute() (llm_continuous's, which returns at once)."""
    values = {s.name: s.value for s in parse_prometheus(scrape(server.metrics_url))
              if s.labels.get("model") == model and s.name in (names.PENDING_REQUESTS, names.EXEC_COUNT)}
    return values.get(names.PENDING_REQUESTS, 0.0) + values.get(names.EXEC_COUNT, 0.0)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {WAIT_S} s"
        time.sleep(0.02)


@pytest.mark.parametrize("model", names.MODELS)
def test_a_high_priority_request_is_admitted_ahead_of_queued_low_priority_ones(one_seat_server, release_file, model):
    url = one_seat_server.grpc_url
    held = Path(f"{release_file}.held")
    release_file.unlink(missing_ok=True)
    held.unlink(missing_ok=True)
    blocker = start_stream(url, model, f"the batch job that holds the seat {HOLD}", max_tokens=16,
                           priority=BATCH, **GREEDY)
    streams = [blocker]
    try:
        wait_for(held.exists, "held step")  # it holds the seat, in its first step
        before = arrived(one_seat_server, model)
        queued = [start_stream(url, model, f"batch job {i}", max_tokens=4, priority=BATCH, **GREEDY) for i in range(2)]
        streams += queued
        wait_for(lambda: arrived(one_seat_server, model) >= before + 2, "arrival of the batch jobs")
        urgent = start_stream(url, model, "an interactive request", max_tokens=4, priority=INTERACTIVE, **GREEDY)
        streams.append(urgent)
        wait_for(lambda: arrived(one_seat_server, model) >= before + 3, "arrival of the interactive request")
        assert not blocker.chunks, "the seat was freed before the high-priority request came"
        release_file.touch()
        for stream in streams:
            assert stream.wait(timeout=120) and stream.error is None, stream.error
        first_token = urgent.arrival_times[0]
        assert all(first_token < stream.arrival_times[0] for stream in queued), \
            [urgent.arrival_times[0] - s.arrival_times[0] for s in queued]
    finally:
        release_file.touch()  # a failed wait must not leave the next model's first step held
        for stream in streams:
            stream.close(cancel=True)
    # Each level's requests are counted under their own label, beside the unlabelled series.
    series = parse_prometheus(scrape(one_seat_server.metrics_url))
    counted = {s.labels.get("priority") for s in series if s.labels.get("model") == model
               and s.name == f"{names.TIME_TO_FIRST_TOKEN_BY_PRIORITY}_count" and s.value > 0}
    assert {str(INTERACTIVE), str(BATCH)} <= counted
