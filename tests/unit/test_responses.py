"""The server glue's responses and per-step IPC, without a server (fakes stand in for ``triton_python_backend_utils``).

What one engine output sends (``send_output``): a delta while streaming, the whole text at the end otherwise, and
exactly one response flagged final per request. And what a step costs: each ``is_cancelled()`` and each metric update
is a round trip to tritonserver paid on the thread that steps the engine, so cancellations are polled on a timer and
gauges are set only when they change; these tests count the calls a step makes."""

from __future__ import annotations

import threading

import pytest

from backend.contract.stop_board import StopBoard
from backend.engine.batching import SHUTTING_DOWN
from backend.engine.llm_engine import EngineSnapshot, RequestOutput
from backend.engine.request import RequestTimings
from backend.triton.stub import responses
from backend.triton.stub.metrics import TritonMetrics
from backend.triton.stub.responses import CancellationPoll, OpenRequest, OpenRequests
from tests.fakes import FakeClock, FakeResponse, FakeResponsePb


class FakeSender:
    def __init__(self, cancelled: bool = False) -> None:
        self.cancelled, self.asked = cancelled, 0

    def is_cancelled(self) -> bool:
        self.asked += 1
        return self.cancelled


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(responses.time, "monotonic", fake)
    return fake


def open_requests(**senders: FakeSender) -> OpenRequests:
    requests = OpenRequests(pb=None, metrics=None, batched=False)
    for request_id, sender in senders.items():
        requests.add(request_id, OpenRequest(sender, stream=True))
    return requests


def test_cancellations_are_polled_on_a_timer_not_every_step(clock):
    running, waiting = FakeSender(), FakeSender(cancelled=True)
    poll = CancellationPoll(open_requests(run=running, wait=waiting), budget=0, streaming_every=0.05, all_every=0.25)
    assert poll(["run"]) == ["wait"]  # the first poll looks at every open request
    assert (running.asked, waiting.asked) == (1, 1)
    for _ in range(10):  # steps within 50 ms: no IPC at all
        clock.now += 0.004
        assert poll(["run"]) == []
    assert running.asked == 1
    clock.now += 0.02  # 60 ms after the first poll: the running requests are asked again, the waiting one is not
    running.cancelled = True
    assert poll(["run"]) == ["run"]
    assert (running.asked, waiting.asked) == (2, 1)
    clock.now += 0.25  # and every 250 ms every open request
    assert sorted(poll(["run"])) == ["run", "wait"]
    assert (running.asked, waiting.asked) == (3, 2)


def test_a_cancelled_request_is_found_within_one_poll_interval(clock):
    sender = FakeSender()
    poll = CancellationPoll(open_requests(a=sender), budget=0, streaming_every=0.05, all_every=0.25)
    poll(["a"])
    sender.cancelled = True
    found_at = None
    for step in range(1, 100):
        clock.now += 0.01  # 10 ms steps
        if poll(["a"]):
            found_at = step
            break
    assert found_at is not None and found_at * 0.01 <= 0.05 + 0.01


def test_a_request_is_not_closed_while_its_client_is_asked_whether_it_cancelled():
    """A refusal closes and answers its request on execute()'s thread while the engine's thread may be polling: the
    poll must never ask a request that has had its final response (that crashed tritonserver 2.51)."""
    requests = OpenRequests(pb=None, metrics=None, batched=False)

    class ClosedWhileAsked(FakeSender):
        def is_cancelled(self) -> bool:
            self.closer = threading.Thread(target=requests.discard, args=("a",))
            self.closer.start()
            self.closer.join(0.2)
            self.closed_meanwhile = not self.closer.is_alive()
            return False

    sender = ClosedWhileAsked()
    requests.add("a", OpenRequest(sender, stream=True))
    assert requests.cancelled() == []
    sender.closer.join(5)
    assert not sender.closed_meanwhile and len(requests) == 0


def test_a_request_posted_on_the_stop_board_is_stopped_at_every_poll_without_asking_the_server(clock, tmp_path):
    """The OpenAI frontend ends a request by posting its Triton id (backend/contract/stop_board.py), not by cancelling
    its stream: every poll reads the board, between the timer's polls too, and asks no sender anything for it."""
    board = StopBoard(tmp_path).clear()
    requests = OpenRequests(pb=None, metrics=None, batched=False, stop_board=board)
    running, waiting, other = FakeSender(), FakeSender(), FakeSender()
    requests.add("r1", OpenRequest(running, stream=True, client_id="openai-1"))
    requests.add("r2", OpenRequest(waiting, stream=True, client_id="openai-2"))
    requests.add("r3", OpenRequest(other, stream=True))  # a client that gave no id
    poll = CancellationPoll(requests, budget=0, streaming_every=0.05, all_every=0.25)
    assert poll(["r1"]) == []  # the first poll asks every sender
    asked = (running.asked, waiting.asked, other.asked)
    board.post("openai-2")
    board.post("openai-9")  # a request this model does not hold
    clock.now += 0.001  # long before the timer's next poll
    assert poll(["r1"]) == ["r2"]  # waiting requests too: the post names them all
    assert (running.asked, waiting.asked, other.asked) == asked
    assert requests.stopped(["r1"]) == [] and requests.stopped(["r1", "r2"]) == ["r2"]
    requests.discard("r2")  # answered finally: no longer stopped, whatever the board says
    assert poll(["r1"]) == [] and requests.stopped() == []


def test_a_stopped_request_is_named_once_with_its_cancellation():
    board_dir = {"openai-1"}

    class Board:
        def posted(self):
            return frozenset(board_dir)

    requests = OpenRequests(pb=None, metrics=None, batched=False, stop_board=Board())
    requests.add("r1", OpenRequest(FakeSender(cancelled=True), stream=True, client_id="openai-1"))
    assert CancellationPoll(requests, budget=0)(["r1"]) == ["r1"]


def test_a_reused_client_id_names_the_latest_open_request_and_closing_an_older_one_keeps_it(tmp_path):
    board = StopBoard(tmp_path).clear()
    requests = OpenRequests(pb=None, metrics=None, batched=False, stop_board=board)
    requests.add("old", OpenRequest(FakeSender(), stream=True, client_id="same"))
    requests.add("new", OpenRequest(FakeSender(), stream=True, client_id="same"))
    requests.discard("old")
    board.post("same")
    assert requests.stopped() == ["new"]


class FakeMetric:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def set(self, value):
        self.log.append((self.name, "set", value))

    def observe(self, value):
        self.log.append((self.name, "observe", value))

    def increment(self, value):
        self.log.append((self.name, "increment", value))


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    log: list = []

    def __init__(self, name, description, kind) -> None:
        self.name = name

    def Metric(self, labels, buckets=None):
        return FakeMetric(FakeFamily.log, self.name)


class FakePb:
    MetricFamily = FakeFamily


class FakeStats:
    def __init__(self) -> None:
        self.records = []

    def recent_steps(self):
        return self.records


class FakeEngine:
    def __init__(self) -> None:
        self.stats = FakeStats()
        self.state = dict(num_running=0, num_waiting=0, num_kv_blocks_used=0, num_kv_blocks_total=100)

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(num_steps=len(self.stats.records), running_request_ids=(), **self.state)


def test_gauges_are_set_only_when_their_value_changes():
    FakeFamily.log = []
    metrics = TritonMetrics(FakePb, "m")
    engine = FakeEngine()
    metrics.on_steps(engine)
    first = [entry for entry in FakeFamily.log if entry[1] == "set"]
    assert ("llm_kv_blocks_total", "set", 100) in first and ("llm_num_requests_running", "set", 0) in first
    FakeFamily.log.clear()
    metrics.on_steps(engine)  # nothing changed: no IPC
    assert FakeFamily.log == []
    engine.state["num_kv_blocks_used"] = 7
    metrics.on_steps(engine)
    assert FakeFamily.log == [("llm_kv_blocks_used", "set", 7)]
    FakeFamily.log.clear()
    metrics.set_healthy(True)  # already healthy
    metrics.set_healthy(False)
    metrics.set_healthy(False)
    assert FakeFamily.log == [("llm_engine_healthy", "set", 0)]


def test_a_finished_request_is_counted_under_the_unlabelled_names_and_by_its_priority_level():
    """Dashboards read the unlabelled names; the ``*_by_priority`` families add the level (their own names, so a sum
    over a name's series counts each request once)."""
    FakeFamily.log = []
    metrics = TritonMetrics(FakePb, "m")
    FakeFamily.log.clear()
    timings = RequestTimings(arrival=10.0, first_scheduled=10.5, first_token=11.0, finished=13.0)
    metrics.on_finished(RequestOutput("r", "", [], finished=True, finish_reason="length", num_output_tokens=5,
                                      timings=timings, num_preemptions=2), arrival=10.0, priority=1)
    observed = {(name, kind, value) for name, kind, value in FakeFamily.log}
    for name in ("llm_queue_time_seconds", "llm_queue_time_by_priority_seconds"):
        assert (name, "observe", 0.5) in observed
    for name in ("llm_time_to_first_token_seconds", "llm_time_to_first_token_by_priority_seconds"):
        assert (name, "observe", 1.0) in observed
    for name in ("llm_time_per_output_token_seconds", "llm_time_per_output_token_by_priority_seconds"):
        assert (name, "observe", 0.5) in observed
    assert ("llm_preemptions_by_priority_total", "increment", 2) in observed
    assert metrics._of_level.keys() == {1}  # a level's series exist once one of its requests ended


def test_prefix_cache_queries_and_hits_count_prompt_tokens_once_per_request():
    FakeFamily.log = []
    metrics = TritonMetrics(FakePb, "m")
    FakeFamily.log.clear()
    for cached in (0, 32):
        metrics.on_finished(RequestOutput("r", "", [], finished=True, finish_reason="stop", num_prompt_tokens=40,
                                          num_output_tokens=1, num_cached_tokens=cached), arrival=0.0)
    counted = [(name, value) for name, kind, value in FakeFamily.log if name.startswith("llm_prefix_cache")]
    assert counted == [("llm_prefix_cache_queries_total", 40), ("llm_prefix_cache_queries_total", 40),
                       ("llm_prefix_cache_hits_total", 32)]


# ---- what one engine output sends (send_output), without a server ---------------------------------------------


class RecordingSender:
    def __init__(self) -> None:
        self.sent: list[tuple[FakeResponse, int]] = []

    def send(self, response: FakeResponse, flags: int = 0) -> None:
        self.sent.append((response, flags))

    def finals(self) -> int:
        return sum(flags == FakeResponsePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL for _, flags in self.sent)


def step_outputs(request_id: str = "r") -> list[RequestOutput]:
    """Three steps of one request: two tokens, one more, then the last with the finish reason."""
    return [
        RequestOutput(request_id, "Hel", [10, 11], num_prompt_tokens=4, num_output_tokens=2),
        RequestOutput(request_id, "lo", [12], num_prompt_tokens=4, num_output_tokens=3),
        RequestOutput(request_id, "!", [13], finished=True, finish_reason="length", num_prompt_tokens=4,
                      num_output_tokens=4),
    ]


def texts(response: FakeResponse) -> list[str]:
    return [value.decode() for value in response.tensors["text_output"].reshape(-1)]


def test_a_streaming_request_gets_each_delta_and_the_last_one_is_final():
    sender = RecordingSender()
    open_request = OpenRequest(sender, stream=True)
    for output in step_outputs():
        responses.send_output(FakeResponsePb, open_request, output, batched=False)
    assert [texts(r) for r, _ in sender.sent] == [["Hel"], ["lo"], ["!"]]
    assert [flags for _, flags in sender.sent] == [0, 0, 1]
    assert [r.tensors["output_ids"].tolist() for r, _ in sender.sent] == [[10, 11], [12], [13]]
    last = sender.sent[-1][0]
    assert last.error is None and last.tensors["finish_reason"].tolist() == [b"length"]
    assert (last.tensors["num_input_tokens"].tolist(), last.tensors["num_output_tokens"].tolist()) == ([4], [4])
    # Before the end only the new text and ids: no finish reason, no counts (unless a return_* switch asks).
    assert [sorted(r.tensors) for r, _ in sender.sent[:2]] == [["output_ids", "text_output"]] * 2


def test_a_non_streaming_request_gets_one_final_response_with_the_whole_text():
    sender = RecordingSender()
    open_request = OpenRequest(sender, stream=False)
    for output in step_outputs():
        responses.send_output(FakeResponsePb, open_request, output, batched=True)
    ((response, flags),) = sender.sent
    assert flags == 1 and response.error is None
    assert response.tensors["text_output"].shape == (1, 1) and texts(response) == ["Hello!"]
    assert response.tensors["output_ids"].tolist() == [[10, 11, 12, 13]]  # batched: a leading batch dimension


def n_outputs() -> list[RequestOutput]:
    """Two sequences of one request: sequence 1 ends first, sequence 0's end is the request's final output."""
    return [
        RequestOutput("r", "A", [1], index=0, num_prompt_tokens=4, num_output_tokens=1),
        RequestOutput("r", "B", [2], index=1, num_prompt_tokens=4, num_output_tokens=1),
        RequestOutput("r", "b", [3], index=1, finish_reason="stop", num_prompt_tokens=4, num_output_tokens=2),
        RequestOutput("r", "a", [4], index=0, finished=True, finish_reason="length", num_prompt_tokens=4,
                      num_output_tokens=2),
    ]


def test_a_streamed_request_with_n_sequences_gets_each_ones_deltas_with_its_index():
    sender = RecordingSender()
    open_request = OpenRequest(sender, stream=True, n=2)
    for output in n_outputs():
        responses.send_output(FakeResponsePb, open_request, output, batched=False)
    sent = [(texts(r), r.tensors["index"].tolist(), flags) for r, flags in sender.sent]
    assert sent == [(["A"], [0], 0), (["B"], [1], 0), (["b"], [1], 0), (["a"], [0], 1)]
    assert [r.tensors["finish_reason"].tolist() for r, _ in sender.sent[2:]] == [[b"stop"], [b"length"]]


def test_every_sequence_of_a_request_with_n_counts_its_tokens_and_the_request_is_counted_once():
    class Metrics(CountingMetrics):
        def __init__(self) -> None:
            super().__init__()
            self.sequence_tokens: list[int] = []

        def on_sequence_finished(self, output: RequestOutput) -> None:
            self.sequence_tokens.append(output.num_output_tokens)

    metrics = Metrics()
    requests = OpenRequests(FakeResponsePb, metrics, batched=False)
    requests.add("r", OpenRequest(RecordingSender(), stream=True, n=2))
    for output in n_outputs():
        requests.send(output)
    assert (metrics.sequence_tokens, metrics.finished) == ([2], ["length"])


def test_a_non_streamed_request_with_n_sequences_gets_each_whole_text_when_it_ends():
    sender = RecordingSender()
    open_request = OpenRequest(sender, stream=False, n=2)
    for output in n_outputs():
        responses.send_output(FakeResponsePb, open_request, output, batched=False)
    sent = [(texts(r), r.tensors["index"].tolist(), r.tensors["output_ids"].tolist(), flags)
            for r, flags in sender.sent]
    assert sent == [(["Bb"], [1], [2, 3], 0), (["Aa"], [0], [1, 4], 1)]


def test_an_error_output_is_a_final_error_response_without_tensors():
    sender = RecordingSender()
    failed = RequestOutput("r", "", [], finished=True, finish_reason="abort", error=SHUTTING_DOWN)
    responses.send_output(FakeResponsePb, OpenRequest(sender, stream=False), failed, batched=False)
    ((response, flags),) = sender.sent
    assert flags == 1 and response.tensors == {} and response.error.message == SHUTTING_DOWN  # the code with it


def test_outputs_a_request_turned_off_are_left_out():
    sender = RecordingSender()
    open_request = OpenRequest(sender, stream=True, omitted_outputs=frozenset({"finish_reason", "num_input_tokens"}))
    responses.send_output(FakeResponsePb, open_request, step_outputs()[-1], batched=False)
    assert sorted(sender.sent[0][0].tensors) == ["num_output_tokens", "output_ids", "text_output"]


class CountingMetrics:
    def __init__(self) -> None:
        self.finished: list[str] = []

    def on_finished(self, output: RequestOutput, arrival: float, priority: int = 2) -> None:
        self.finished.append(output.finish_reason)


def test_open_requests_send_one_final_response_per_request_and_count_all_but_refusals():
    metrics, senders = CountingMetrics(), {"a": RecordingSender(), "b": RecordingSender()}
    requests = OpenRequests(FakeResponsePb, metrics, batched=False)
    for request_id, sender in senders.items():
        requests.add(request_id, OpenRequest(sender, stream=True))
    for output in step_outputs("a"):
        requests.send(output)
    requests.send(RequestOutput("a", "late", [14], finished=True, finish_reason="stop"))  # after its final: dropped
    requests.send(RequestOutput("b", "", [], finished=True, finish_reason="refused", error="too long"))
    assert [sender.finals() for sender in senders.values()] == [1, 1] and len(requests) == 0
    assert len(senders["a"].sent) == 3 and metrics.finished == ["length"]  # a refusal is not a finished request


def test_logprobs_go_only_to_requests_that_ask_one_entry_per_token_of_the_response():
    import json

    from backend.engine.llm_engine import Logprob

    outputs = step_outputs()
    for output in outputs:
        output.logprobs = [{t: Logprob(-0.5, 1, f"t{t}"), 99: Logprob(-2.0, 2, "x")} for t in output.new_token_ids]
    plain = RecordingSender()
    for output in outputs:
        responses.send_output(FakeResponsePb, OpenRequest(plain, stream=True), output, batched=False)
    assert all("logprobs" not in r.tensors for r, _ in plain.sent)
    asking = RecordingSender()
    open_request = OpenRequest(asking, stream=True, requested_outputs=frozenset({"logprobs"}))
    for output in outputs:
        responses.send_output(FakeResponsePb, open_request, output, batched=False)
    sent = [json.loads(r.tensors["logprobs"].reshape(-1)[0]) for r, _ in asking.sent]
    assert [len(entries) for entries in sent] == [2, 1, 1]  # one per token of output_ids
    assert sent[0][0] == {"10": {"logprob": -0.5, "rank": 1, "decoded_token": "t10"},
                          "99": {"logprob": -2.0, "rank": 2, "decoded_token": "x"}}


def test_prompt_logprobs_go_once_in_the_first_response_sent_null_first():
    import json

    from backend.engine.llm_engine import Logprob

    prompt = [None, {5: Logprob(-1.5, 2, "a"), 7: Logprob(-0.2, 1, "b")}]
    for stream in (True, False):
        outputs = step_outputs()
        outputs[0].prompt_logprobs = prompt
        sender = RecordingSender()
        open_request = OpenRequest(sender, stream=stream)
        for output in outputs:
            responses.send_output(FakeResponsePb, open_request, output, batched=False)
        carrying = [r.tensors["prompt_logprobs"] for r, _ in sender.sent if "prompt_logprobs" in r.tensors]
        assert len(carrying) == 1 and "prompt_logprobs" in sender.sent[0][0].tensors
        assert json.loads(carrying[0].reshape(-1)[0]) == [None, {
            "5": {"logprob": -1.5, "rank": 2, "decoded_token": "a"},
            "7": {"logprob": -0.2, "rank": 1, "decoded_token": "b"}}]
    plain = RecordingSender()
    for output in step_outputs():
        responses.send_output(FakeResponsePb, OpenRequest(plain, stream=True), output, batched=False)
    assert all("prompt_logprobs" not in r.tensors for r, _ in plain.sent)
