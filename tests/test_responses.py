"""The server glue's per-step IPC: cancellations are polled on a timer, gauges are set only when they change.

Each ``is_cancelled()`` and each metric update is a round trip to tritonserver paid on the thread that steps the
engine, so these tests count the calls a step makes (fakes stand in for ``triton_python_backend_utils``)."""

from __future__ import annotations

import pytest

from backend.engine.llm_engine import EngineSnapshot
from backend.triton import responses
from backend.triton.metrics import TritonMetrics
from backend.triton.responses import CancellationPoll, OpenRequest, OpenRequests


class FakeSender:
    def __init__(self, cancelled: bool = False) -> None:
        self.cancelled, self.asked = cancelled, 0

    def is_cancelled(self) -> bool:
        self.asked += 1
        return self.cancelled


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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
    poll = CancellationPoll(open_requests(run=running, wait=waiting), streaming_every=0.05, all_every=0.25)
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
    poll = CancellationPoll(open_requests(a=sender), streaming_every=0.05, all_every=0.25)
    poll(["a"])
    sender.cancelled = True
    found_at = None
    for step in range(1, 100):
        clock.now += 0.01  # 10 ms steps
        if poll(["a"]):
            found_at = step
            break
    assert found_at is not None and found_at * 0.01 <= 0.05 + 0.01


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
