"""The cancellation poll pays for its ``is_cancelled()`` round trips from a budget of the stepping thread's time:
a few running requests are each asked before every step (a cancelled one is found after one step), a large batch is
asked round-robin, and the time spent asking stays near the budget however large the batch. Fakes stand in for
Triton; the clock advances by the cost of each ask."""

from __future__ import annotations

import pytest

from backend.triton.stub.responses import CancellationPoll, OpenRequest, OpenRequests

ASK_S = 35e-6  # one is_cancelled() round trip, as measured on the development machine
STEP_S = 0.025  # one engine step of SmolLM2 at a few sequences


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.asking = 0.0  # seconds spent inside is_cancelled()

    def __call__(self) -> float:
        return self.now


class Sender:
    def __init__(self, clock: Clock) -> None:
        self.clock, self.cancelled, self.asked = clock, False, 0

    def is_cancelled(self) -> bool:
        self.asked += 1
        self.clock.now += ASK_S
        self.clock.asking += ASK_S
        return self.cancelled


@pytest.fixture
def clock():
    return Clock()


def running(clock: Clock, count: int) -> tuple[OpenRequests, dict[str, Sender]]:
    open_requests = OpenRequests(pb=None, metrics=None, batched=False)
    senders = {f"r{i}": Sender(clock) for i in range(count)}
    for request_id, sender in senders.items():
        open_requests.add(request_id, OpenRequest(sender, stream=True))
    return open_requests, senders


def steps(clock: Clock, poll: CancellationPoll, ids: list[str], count: int) -> list[list[str]]:
    found = []
    for _ in range(count):
        clock.now += STEP_S
        found.append(poll(ids))
    return found


@pytest.mark.parametrize("batch", [1, 4])
def test_a_small_batch_is_asked_before_every_step(clock, batch):
    open_requests, senders = running(clock, batch)
    poll, ids = CancellationPoll(open_requests, clock=clock), list(senders)
    steps(clock, poll, ids, 5)  # the first poll (every open request) and the budget filling up
    asked = {rid: s.asked for rid, s in senders.items()}
    steps(clock, poll, ids, 10)
    assert all(senders[rid].asked - asked[rid] == 10 for rid in ids), "each running request asked every step"
    senders["r0"].cancelled = True
    assert steps(clock, poll, ids, 1) == [["r0"]], "a client that went away is found before the next step"


def test_the_timer_alone_would_take_several_steps(clock):
    """The baseline the budget improves on: without it a cancelled request waits up to ``streaming_every``."""
    open_requests, senders = running(clock, 1)
    poll = CancellationPoll(open_requests, budget=0, clock=clock)
    steps(clock, poll, ["r0"], 2)
    senders["r0"].cancelled = True
    found = steps(clock, poll, ["r0"], 10)
    assert found.index(["r0"]) >= 4, found


def test_a_large_batch_is_asked_round_robin_within_the_budget(clock):
    open_requests, senders = running(clock, 32)
    poll = CancellationPoll(open_requests, budget=0.01, streaming_every=10.0, all_every=100.0, clock=clock)
    ids = list(senders)
    steps(clock, poll, ids, 3)
    asked = {rid: s.asked for rid, s in senders.items()}
    clock.asking, started = 0.0, clock.now
    steps(clock, poll, ids, 40)
    per_request = [senders[rid].asked - asked[rid] for rid in ids]
    assert max(per_request) - min(per_request) <= 2, f"round-robin: every request asked alike, {per_request}"
    assert min(per_request) >= 5, "each asked every few steps"
    assert clock.asking <= 0.012 * (clock.now - started), "the time spent asking stays within the budget"
    senders["r17"].cancelled = True
    found = steps(clock, poll, ids, 6)
    assert ["r17"] in found, f"found within 32 / (asks per step) steps: {found}"
