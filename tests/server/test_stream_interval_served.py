"""``stream_interval`` on a real server (the tiny Llama): a stream sent every 4 steps carries exactly the tokens and
text of one sent every step, over gRPC streaming and HTTP ``generate_stream``, for each way of deciding the batch;
its first response carries the first token alone, its intermediate responses only the new text and ids.

Each prompt runs alone (one sequence per step) on each model, so both modes run the same steps and nothing depends on
float rounding; ``ignore_eos`` makes every request generate its ``max_tokens``.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import requests

from backend.triton.launcher import config_text
from client import grpc_stream
from tests.server_harness import make_repository

pytestmark = pytest.mark.server

EVERY = 4
MAX_TOKENS = 19
GROUPED = ("llm_continuous", "llm_dynamic", "llm_iterative")  # every EVERY steps
EACH_STEP = "llm_continuous_each_step"  # every step, as before stream_interval
PROMPTS = ["Once upon a time", "The capital of France is", "def f(x):"]
REQUEST = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stream=True)


@pytest.fixture(scope="module")
def server(triton_server_factory, tiny_llama_dir, tmp_path_factory):
    # NOTE: stream_interval_ms far above the run's length: only the step count decides here.
    repository = make_repository(tmp_path_factory.mktemp("stream-interval"),
                                 {"stream_interval": str(EVERY), "stream_interval_ms": "600000"}, models=GROUPED)
    each = repository / EACH_STEP
    shutil.copytree(repository / "llm_continuous", each)
    with config_text.edit(each / "config.pbtxt") as config:
        config.name = EACH_STEP
        config_text.set_parameters(config, {"stream_interval": "1"}, add_missing=False)
    server = triton_server_factory.start(repository, model=tiny_llama_dir)
    yield server
    server.stop()


def stream(server, model: str, prompt: str):
    result = grpc_stream.generate(server.grpc_url, model, prompt, timeout=120, **REQUEST)
    assert result.final and result.error is None, f"{model}: {result.error}"
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", GROUPED)
def test_a_stream_sent_every_four_steps_carries_what_one_sent_every_step_carries(server, model):
    for prompt in PROMPTS:
        each_step, grouped = stream(server, EACH_STEP, prompt), stream(server, model, prompt)
        assert len(each_step.chunks) == MAX_TOKENS  # one response per token
        assert grouped.token_ids == each_step.token_ids and len(grouped.token_ids) == MAX_TOKENS
        assert grouped.text == each_step.text
        first, *middle, last = grouped.chunks
        assert len(first.output_ids) == 1  # the first token alone, at once
        assert len(grouped.chunks) <= 2 + math.ceil((MAX_TOKENS - 1) / EVERY) < MAX_TOKENS
        assert all(c.finish_reason is None and c.num_output_tokens is None for c in [first, *middle])
        assert (last.finish_reason, last.num_output_tokens) == ("length", MAX_TOKENS)


def ids(events: list[dict]) -> list[int]:
    """The token ids of the events in order (JSON gives a one-element output as a number or as a list)."""
    return [i for e in events for i in (e["output_ids"] if isinstance(e["output_ids"], list) else [e["output_ids"]])]


@pytest.mark.timeout(300)
def test_http_generate_stream_gets_the_same_text_in_fewer_events(server):
    prompt = PROMPTS[0]
    body = {"text_input": prompt, **REQUEST}
    events = {}
    for model in (EACH_STEP, "llm_continuous"):
        sse = requests.post(f"{server.http_url}/v2/models/{model}/generate_stream", json=body, timeout=120,
                            stream=True)
        events[model] = [json.loads(line[len(b"data: "):]) for line in sse.iter_lines() if line.startswith(b"data: ")]
    each_step, grouped = events[EACH_STEP], events["llm_continuous"]
    assert len(each_step) == MAX_TOKENS and len(grouped) < MAX_TOKENS
    assert "".join(e["text_output"] for e in grouped) == "".join(e["text_output"] for e in each_step)
    assert ids(grouped) == ids(each_step) and len(ids(grouped)) == MAX_TOKENS
    assert grouped[-1]["finish_reason"] == "length" and grouped[-1]["num_output_tokens"] == MAX_TOKENS
