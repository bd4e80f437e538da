"""``stream_interval``: a stream sent every N steps carries exactly the tokens and text of one sent every step, its
first token is never held back, its final response has everything left with the counts and the finish reason, and the
adaptive rule switches where its formula says it should.

The outputs are the real engine's (the tiny random Llama, ``ignore_eos`` so every request makes its ``max_tokens``),
recorded once and replayed through the responses layer in each mode: the modes are compared against each other on
the same outputs, so nothing here depends on float rounding. Fakes stand in for ``triton_python_backend_utils``.
"""

from __future__ import annotations

import math

import pytest

from backend.engine.config import EngineConfig
from backend.engine.llm_engine import LLMEngine, RequestOutput
from backend.engine.sampling_params import SamplingParams
from backend.triton.stub.model_config import engine_config_from_triton, stream_interval_from_triton
from backend.triton.stub.responses import OpenRequest, OpenRequests
from backend.triton.stub.stream_interval import (
    MIN_STREAMS_TO_GROUP,
    SEND_BUDGET,
    SENDING_BOUND,
    StreamInterval,
    StreamPacer,
    adaptive_interval,
)
from tests.fakes import FakeClock, FakeResponse, FakeResponsePb

# ---- fakes ---------------------------------------------------------------------------------------------------------


class Sent:
    def __init__(self, step: int, response: FakeResponse, flags: int) -> None:
        self.step, self.flags, self.tensors = step, flags, response.tensors

    @property
    def text(self) -> str:
        return b"".join(self.tensors["text_output"].reshape(-1)).decode()

    @property
    def ids(self) -> list[int]:
        return self.tensors["output_ids"].reshape(-1).tolist()


class Sender:
    """Records each response with the step it was sent in; sending costs ``cost`` seconds of the fake clock."""

    def __init__(self, steps: list[int], clock: FakeClock | None = None, cost: float = 0.0) -> None:
        self.steps, self.clock, self.cost = steps, clock, cost
        self.sent: list[Sent] = []

    def send(self, response: FakeResponse, flags: int = 0) -> None:
        self.sent.append(Sent(self.steps[0], response, flags))
        if self.clock is not None:
            self.clock.now += self.cost


class NoMetrics:
    def on_finished(self, output, arrival, priority=2) -> None:
        pass


def replay(steps: list[list[RequestOutput]], config: StreamInterval, clock: FakeClock | None = None,
           step_s: float = 0.02, requested: frozenset[str] = frozenset()) -> dict[str, Sender]:
    """Send the recorded steps' outputs through the one place that sends, paced by ``config``; each step takes
    ``step_s`` of the fake clock."""
    clock = clock or FakeClock()
    current = [0]
    open_requests = OpenRequests(FakeResponsePb, NoMetrics(), batched=False, pacer=StreamPacer(config, clock=clock))
    senders = {}
    for outputs in steps:
        for output in outputs:
            if output.request_id not in senders:
                senders[output.request_id] = Sender(current, clock)
                open_requests.add(output.request_id, OpenRequest(senders[output.request_id], stream=True,
                                                                 requested_outputs=requested))
    for index, outputs in enumerate(steps):
        current[0] = index
        clock.now += step_s
        for output in outputs:
            open_requests.send(output)
        open_requests.end_step()
    assert len(open_requests) == 0
    return senders


# ---- the engine's outputs, recorded once ---------------------------------------------------------------------------

# Requests that join at different steps and end at different steps; one sampled (seeded), the others greedy.
REQUESTS = [
    ("a", "Once upon a time", SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True), 0),
    ("b", "The capital of France is", SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True), 0),
    ("c", "def f(x):", SamplingParams(max_tokens=30, temperature=1.0, seed=7, ignore_eos=True), 2),
    ("d", "1, 2, 3,", SamplingParams(max_tokens=9, min_tokens=9, temperature=0.0, ignore_eos=True), 5),
]


@pytest.fixture(scope="module")
def engine_steps(tiny_llama_dir) -> list[list[RequestOutput]]:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_threads=1, max_num_seqs=8,
                                    max_model_len=256, num_kv_blocks=64, block_size=16))
    steps, index = [], 0
    while index == 0 or engine.has_unfinished():
        for request_id, prompt, params, join_at in REQUESTS:
            if join_at == index:
                engine.add_request(request_id, prompt, params)
        steps.append(engine.step())
        index += 1
    return steps


def whole(steps: list[list[RequestOutput]], request_id: str) -> tuple[str, list[int]]:
    outputs = [o for step in steps for o in step if o.request_id == request_id]
    return "".join(o.delta_text for o in outputs), [i for o in outputs for i in o.new_token_ids]


# ---- the same stream in fewer responses ----------------------------------------------------------------------------


@pytest.mark.parametrize("every", [2, 3, 4, 8, 100])
def test_a_stream_sent_every_n_steps_carries_the_same_tokens_and_text_as_one_sent_every_step(engine_steps, every):
    each_step = replay(engine_steps, StreamInterval(steps=1))
    every_n = replay(engine_steps, StreamInterval(steps=every, max_ms=1e6))
    for request_id, _, params, _ in REQUESTS:
        one, many = each_step[request_id].sent, every_n[request_id].sent
        assert len(one) == params.max_tokens  # every step: one response per token, as before
        assert "".join(s.text for s in many) == "".join(s.text for s in one) == whole(engine_steps, request_id)[0]
        assert [i for s in many for i in s.ids] == [i for s in one for i in s.ids] == whole(engine_steps, request_id)[1]
        assert len(many[-1].ids) >= 1 and [s.flags for s in many] == [0] * (len(many) - 1) + [1]
        # the first response, then one every `every` steps at most, then the final one
        assert len(many) <= 2 + math.ceil((params.max_tokens - 1) / every)
        if every == 100:  # nothing between the first token and the final response
            assert len(many) == 2


@pytest.mark.parametrize("config", [StreamInterval(steps=8, max_ms=1e6), StreamInterval(steps=None)])
def test_the_first_token_is_never_held_back(engine_steps, config):
    senders = replay(engine_steps, config)
    for request_id, _, _, _ in REQUESTS:
        first_step = next(i for i, step in enumerate(engine_steps) if any(o.request_id == request_id for o in step))
        first = senders[request_id].sent[0]
        assert first.step == first_step and len(first.ids) == 1


def test_the_final_response_alone_carries_counts_and_finish_reason_unless_asked_for_in_every_one(engine_steps):
    senders = replay(engine_steps, StreamInterval(steps=3, max_ms=1e6))
    for request_id, _, params, _ in REQUESTS:
        *middle, last = senders[request_id].sent
        assert all(sorted(s.tensors) == ["output_ids", "text_output"] for s in middle)
        assert sorted(last.tensors) == ["finish_reason", "num_input_tokens", "num_output_tokens", "output_ids",
                                        "text_output"]
        assert last.tensors["finish_reason"].tolist() == [b"length"]
        assert last.tensors["num_output_tokens"].tolist() == [params.max_tokens]
    asked = replay(engine_steps, StreamInterval(steps=3, max_ms=1e6), requested=frozenset({"num_output_tokens"}))
    counts = [s.tensors["num_output_tokens"].item() for s in asked["a"].sent]
    assert counts == sorted(counts) and counts[-1] == 23  # in every response: the count so far


def test_a_held_stream_is_sent_at_the_latest_after_stream_interval_ms(engine_steps):
    # 20 ms steps, every 100 steps or every 50 ms: a response every third step (60 ms) after the first token.
    senders = replay(engine_steps, StreamInterval(steps=100, max_ms=50), step_s=0.02)
    sent_steps = [s.step for s in senders["a"].sent]
    assert sent_steps[:4] == [0, 3, 6, 9]
    assert "".join(s.text for s in senders["a"].sent) == whole(engine_steps, "a")[0]


# ---- the adaptive rule ---------------------------------------------------------------------------------------------


def test_the_rule_is_one_until_a_steps_responses_cost_a_tenth_of_the_step_then_brings_them_to_a_twentieth():
    # 20 ms steps, 0.2 ms per response: 10 streams' responses cost a tenth of the step.
    assert (SENDING_BOUND, SEND_BUDGET) == (0.10, 0.05)
    assert [adaptive_interval(n, 200e-6, 0.020) for n in (1, 4, 8, 10)] == [1, 1, 1, 1]
    # 11 streams: 11 % of the step every step; every 3 steps, 3.7 % (every 2, 5.5 %: above the budget)
    assert [adaptive_interval(n, 200e-6, 0.020) for n in (11, 15, 16, 32, 64)] == [3, 3, 4, 7, 13]
    assert adaptive_interval(64, 200e-6, 0.256) == 1  # a slow step: every token at once even at 64 streams
    # below 8 streams, every step however much a response costs; from 8 on, the shares above decide
    assert (MIN_STREAMS_TO_GROUP, adaptive_interval(7, 1e-3, 0.010), adaptive_interval(8, 1e-3, 0.010)) == (8, 1, 16)
    assert adaptive_interval(0, 200e-6, 0.020) == adaptive_interval(8, 0.0, 0.020) == 1


def synthetic_steps(num_streams: int, num_steps: int) -> list[list[RequestOutput]]:
    steps = [[RequestOutput(f"r{i}", "x", [7], num_output_tokens=k + 1) for i in range(num_streams)]
             for k in range(num_steps - 1)]
    return steps + [[RequestOutput(f"r{i}", "x", [7], finished=True, finish_reason="length") for i in
                     range(num_streams)]]


@pytest.mark.parametrize("num_streams, expected", [(1, 1), (6, 1), (12, 3), (32, 7)])
def test_auto_switches_where_the_rule_says_from_what_it_measures(num_streams, expected):
    """Each response costs 0.2 ms of the clock and the rest of a step 20 ms: after a few steps the pacer has measured
    both and sends each stream every ``expected`` steps; each step sends about 1/expected of the streams."""
    clock = FakeClock()
    pacer = StreamPacer(StreamInterval(steps=None, max_ms=1e6), clock=clock)
    open_requests = OpenRequests(FakeResponsePb, NoMetrics(), batched=False, pacer=pacer)
    current = [0]
    senders = [Sender(current, clock, cost=200e-6) for _ in range(num_streams)]
    for i, sender in enumerate(senders):
        open_requests.add(f"r{i}", OpenRequest(sender, stream=True))
    per_step = []
    for index, outputs in enumerate(synthetic_steps(num_streams, 200)):
        current[0] = index
        clock.now += 0.020
        before = sum(len(s.sent) for s in senders)
        for output in outputs:
            open_requests.send(output)
        open_requests.end_step()
        per_step.append(sum(len(s.sent) for s in senders) - before)
    assert pacer.interval == expected
    assert pacer.send_cost_s == pytest.approx(200e-6) and pacer.step_s == pytest.approx(0.020)
    assert max(per_step[150:199]) <= math.ceil(num_streams / expected)  # staggered: no step sends them all
    assert all(sum(len(s.ids) for s in sender.sent) == 200 for sender in senders)


def test_a_fixed_interval_is_not_changed_by_what_is_measured():
    clock = FakeClock()
    pacer = StreamPacer(StreamInterval(steps=1), clock=clock)
    open_requests = OpenRequests(FakeResponsePb, NoMetrics(), batched=False, pacer=pacer)
    senders = [Sender([0], clock, cost=1e-3) for _ in range(64)]
    for i, sender in enumerate(senders):
        open_requests.add(f"r{i}", OpenRequest(sender, stream=True))
    for outputs in synthetic_steps(64, 20):
        clock.now += 0.010
        for output in outputs:
            open_requests.send(output)
        open_requests.end_step()
    assert pacer.interval == 1 and all(len(s.sent) == 20 for s in senders)


# ---- the settings --------------------------------------------------------------------------------------------------


def test_the_settings_validate_themselves_and_are_not_engine_settings(smollm2_dir):
    def config(**params):
        return {"parameters": {k: {"string_value": v} for k, v in {"model": str(smollm2_dir), **params}.items()}}

    assert stream_interval_from_triton(config()) == StreamInterval(steps=None, max_ms=500.0)
    assert stream_interval_from_triton(config(stream_interval="4", stream_interval_ms="50")) == StreamInterval(4, 50)
    assert stream_interval_from_triton(config(stream_interval="AUTO")).steps is None
    for bad in ({"stream_interval": "0"}, {"stream_interval": "-2"}, {"stream_interval": "every"},
                {"stream_interval": "1.5"}, {"stream_interval_ms": "0"}, {"stream_interval_ms": "nan"},
                {"stream_interval_ms": "soon"}):
        with pytest.raises(ValueError, match="stream_interval"):
            stream_interval_from_triton(config(**bad))
    engine_config_from_triton(config(stream_interval="4", stream_interval_ms="50"), str(smollm2_dir))  # not refused


def test_the_served_bench_counts_a_response_of_k_tokens_as_k_gaps_of_its_interval():
    from bench.served import spread_tokens

    assert spread_tokens(1.0, 1.3, 3) == pytest.approx([1.1, 1.2, 1.3])  # grouped: three gaps of 0.1 s
    assert spread_tokens(1.0, 1.1, 1) == [1.1]  # one token per response: its arrival, as before
