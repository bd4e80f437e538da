"""llm_iterative's bookkeeping of Triton 2.51's iterative sequence batcher, without a server: ``IterationBook`` is
fed plain values (the requests' sequence controls, the driver's answers, the time) and every decision it makes is
asserted exactly: what is relayed, answered, handed to the step, handed back or released, and which outputs are sent,
held or closed unsent. The rules are the module docstring's (backend/triton/stub/iteration_book.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from backend.triton.stub.iteration_book import (
    AWAIT_EXECUTE_S,
    SEND_AFTER_RELEASE_S,
    HandBack,
    HandIn,
    IterationBook,
    SequenceRequest,
)
from backend.triton.stub.sequence_relay import CANCELLED, FIRST_RELAY_ID, MULTI_REQUEST_SEQUENCE

REAP_AFTER = 30.0  # Triton's idle time (max_sequence_idle_microseconds), seconds


@dataclass(frozen=True)
class Output:
    """An engine output, as much of it as the book reads."""

    request_id: str
    finished: bool = False


class Model:
    """The adapter's side as plain values: which requests the driver has open, which senders a rebind finds closed,
    which clients cancelled; and a record of what the book asked of it."""

    def __init__(self) -> None:
        self.open_ids: set[str] = set()  # the driver's open requests (IterationDriver.is_open)
        self.closed_senders: set[str] = set()  # requests whose final response went out: a rebind fails
        self.cancelled_clients: set[str] = set()  # requests whose clients cancelled them
        self.admitted: list[str] = []
        self.resumed: list[str] = []
        self.asked: list[list[str]] = []  # each question about clients' cancels, in order
        self.book = IterationBook(REAP_AFTER, self.open_ids.__contains__)

    def admit(self, item: SequenceRequest) -> str:  # ServedModel.admit, IterationDriver.add taking the request
        request_id = f"r{item.correlation_id}"
        self.admitted.append(request_id)
        self.open_ids.add(request_id)
        return request_id

    def resume(self, request_id: str, item: SequenceRequest) -> bool:  # OpenRequests.rebind
        self.resumed.append(request_id)
        return request_id not in self.closed_senders

    def client_cancelled(self, request_ids) -> list[str]:  # OpenRequests.cancelled
        self.asked.append(list(request_ids))
        return [rid for rid in request_ids if rid in self.cancelled_clients]

    def hand_in(self, *items: SequenceRequest, now: float) -> HandIn:
        return self.book.hand_in(items, now, admit=self.admit, resume=self.resume)

    def make(self, request_id: str, finished: bool = False) -> Output:
        """The driver's step makes an output (a final one ends the request); during an execute() it is held."""
        output = Output(request_id, finished)
        if finished:
            self.open_ids.discard(request_id)
        assert self.book.hold(output)
        return output

    def hand_back(self, *unfinished: str, now: float) -> HandBack:
        return self.book.hand_back(set(unfinished), self.client_cancelled, now)


def new(correlation_id: int) -> SequenceRequest:
    return SequenceRequest(correlation_id, start=True, request=f"new {correlation_id}")


def again(correlation_id: int) -> SequenceRequest:
    return SequenceRequest(correlation_id, request=f"rescheduled {correlation_id}")


def held_by_triton() -> Model:
    """r7 handed in and handed back unfinished, its execute() returned: Triton holds it until the next execute()."""
    model = Model()
    model.hand_in(new(7), now=0.0)
    model.hand_back("r7", now=0.5)
    model.book.returned()
    return model


def test_a_new_request_is_admitted_and_handed_back_unfinished_and_what_it_made_waits_for_the_hand_back():
    model = Model()
    first = new(7)
    assert model.hand_in(first, now=100.0) == HandIn(handed={"r7": first})
    assert model.admitted == ["r7"] and model.book.request_ids == {7: "r7"}
    token = model.make("r7")
    assert model.hand_back("r7", now=100.5) == HandBack(rescheduled=[first])
    assert model.asked == [[]]  # nothing ended: no client is asked
    assert model.book.returned() is False  # nothing released: the sender has nothing to do
    assert model.book.take_released() == []  # NOTE: never while Triton holds it

    second = again(7)
    assert model.hand_in(second, now=100.75) == HandIn(handed={"r7": second}, send=[token], gap=0.25)
    assert model.resumed == ["r7"] and model.admitted == ["r7"]


def test_a_finished_request_is_released_and_what_it_made_goes_out_after_execute_returns():
    model = Model()
    first = new(7)
    model.hand_in(first, now=0.0)
    token, final = model.make("r7"), model.make("r7", finished=True)
    assert model.hand_back(now=1.0) == HandBack(released=[first])
    assert model.asked == [["r7"]]  # it ended with outputs unsent: did its client cancel it?
    assert model.book.request_ids == {}
    assert model.book.returned() is True  # the sender sends SEND_AFTER_RELEASE_S later
    assert model.book.take_released() == [token, final]
    assert model.book.take_released() == []  # once
    assert model.book.hold(Output("r9", finished=True)) is False  # outside an execute(): sent at once (the reaper)


def test_a_released_requests_outputs_go_out_at_the_next_execute_when_it_comes_sooner():
    model = Model()
    first, second = new(7), new(8)
    model.hand_in(first, second, now=0.0)
    final, token = model.make("r7", finished=True), model.make("r8")
    assert model.hand_back("r8", now=1.0) == HandBack(rescheduled=[second], released=[first])
    assert model.book.returned() is True
    third = again(8)
    # Released ones first, then those handed back, bound to their new senders.
    assert model.hand_in(third, now=1.25) == HandIn(handed={"r8": third}, send=[final, token], gap=0.25)
    assert model.book.take_released() == []


def test_a_request_admit_refuses_is_released_and_its_refusal_sent_in_the_same_execute():
    model = Model()
    invalid, refused = new(7), new(8)

    def admit(item: SequenceRequest) -> str | None:
        if item is invalid:  # not valid: admit sent its error and opened nothing
            return None
        model.book.hold(Output("r8", finished=True))  # the driver refused it: its final output goes to the sink
        return "r8"

    plan = model.book.hand_in([invalid, refused], 0.0, admit=admit, resume=model.resume)
    assert plan == HandIn(released=[invalid, refused], send=[Output("r8", finished=True)])
    assert model.book.request_ids == {}


def test_only_requests_that_ended_with_outputs_unsent_are_asked_about_their_clients_cancel():
    """NOTE: asking a request whose final response went out crashed tritonserver 2.51 (OpenRequests.cancelled)."""
    model = Model()
    quiet, loud, running = new(7), new(8), new(9)
    model.hand_in(quiet, loud, running, now=0.0)
    model.open_ids.discard("r7")  # ended with nothing held for it
    final = model.make("r8", finished=True)
    assert model.hand_back("r9", now=1.0) == HandBack(rescheduled=[running], released=[quiet, loud])
    assert model.asked == [["r8"]]
    assert model.book.returned() is True and model.book.take_released() == [final]


def test_the_hand_back_gap_is_measured_from_an_execute_that_handed_requests_back():
    model = Model()
    first, second = new(7), new(8)
    model.hand_in(first, second, now=0.0)
    model.hand_back("r7", "r8", now=0.5)
    only = again(7)  # Triton ran a subset; it finishes
    assert model.hand_in(only, now=1.0) == HandIn(handed={"r7": only}, gap=0.5)
    final = model.make("r7", finished=True)
    model.hand_back(now=1.5)
    model.book.returned()
    waited = again(8)  # the last execute() handed nothing back: no gap to measure
    assert model.hand_in(waited, now=2.0) == HandIn(handed={"r8": waited}, send=[final])


def test_a_cancel_while_triton_holds_the_request_leaves_it_to_triton_and_nothing_made_is_sent():
    """Before an iteration: Triton answers the cancelled request itself and never hands it back; the driver ends it
    (CANCELLED_AFTER_S, its final output closed unsent)."""
    model = Model()
    first = new(7)
    model.hand_in(first, now=0.0)
    model.make("r7")
    model.hand_back("r7", now=0.5)
    model.book.returned()
    model.open_ids.discard("r7")  # the driver's reaper, between executes

    other = new(8)
    assert model.hand_in(other, now=6.0) == HandIn(handed={"r8": other})  # what r7 made is never sent
    assert model.book.unsent == {}
    assert model.hand_back("r8", now=6.5) == HandBack(rescheduled=[other])
    assert model.book.request_ids == {8: "r8"} and model.book.let_go == {7: 6.5}


def test_a_cancel_during_an_iteration_hands_the_request_back_for_triton_to_answer():
    model = Model()
    first = new(7)
    model.hand_in(first, now=0.0)
    model.make("r7")
    final = model.make("r7", finished=True)  # finished, or aborted by the driver's cancellation check
    model.cancelled_clients.add("r7")
    assert model.hand_back(now=1.0) == HandBack(rescheduled=[first], forgotten=[final])
    assert model.book.cancelled_by_client == {7: 1.0} and model.book.request_ids == {}
    assert model.book.unsent == {}  # what it made is dropped
    assert model.book.returned() is False and model.book.take_released() == []

    # Triton answers it when it finds it cancelled in its queue; one it hands back instead is the model's to answer.
    late = again(7)
    assert model.hand_in(late, now=1.5) == HandIn(answered=[(late, CANCELLED)], released=[late])
    assert model.resumed == [] and model.book.cancelled_by_client == {}


def test_a_cancel_after_the_release_changes_nothing_what_it_made_goes_out():
    model = Model()
    first = new(7)
    model.hand_in(first, now=0.0)
    final = model.make("r7", finished=True)
    assert model.hand_back(now=1.0) == HandBack(released=[first])
    assert model.book.returned() is True
    model.cancelled_clients.add("r7")  # too late: Triton released it, a send may go out at any time
    assert model.book.take_released() == [final]
    assert model.asked == [["r7"]]  # asked once, when it ended


def test_with_no_request_handed_back_what_a_released_request_made_goes_out_soon_after_the_step():
    """No execute() is coming: what the released request made goes out SEND_AFTER_RELEASE_S after the step."""
    model = Model()
    model.hand_in(new(7), now=0.0)
    final = model.make("r7", finished=True)
    model.hand_back(now=1.0)
    assert model.book.returned() is True
    assert model.book.send_wait(1.0) == pytest.approx(SEND_AFTER_RELEASE_S)
    assert model.book.send_wait(1.0 + 2 * SEND_AFTER_RELEASE_S) == 0.0
    assert model.book.take_released() == [final]


def test_what_a_released_request_made_waits_for_the_next_execute_when_requests_were_handed_back():
    """Requests handed back make an execute() come, and Triton calls it only once it has carried out the releases:
    what the released request made waits for it (AWAIT_EXECUTE_S at most), so that a client that cancels on its
    final response cannot cancel a request Triton has not released yet."""
    model = Model()
    model.hand_in(new(7), new(8), now=0.0)
    final, token = model.make("r7", finished=True), model.make("r8")
    model.hand_back("r8", now=1.0)
    assert model.book.returned() is True
    assert model.book.send_wait(1.0) == pytest.approx(AWAIT_EXECUTE_S)
    assert model.book.send_wait(1.0 + AWAIT_EXECUTE_S / 2) > 0.0  # the sender waits
    third = again(8)
    assert model.hand_in(third, now=1.001).send == [final, token]
    assert model.book.take_released() == []
    assert model.book.send_wait(1.0 + AWAIT_EXECUTE_S) == 0.0


def test_a_rescheduled_request_with_an_unknown_correlation_id_is_a_client_sequences_next_request():
    model = Model()
    second = again(42)  # no START, and none of ours is open under 42
    assert model.hand_in(second, now=0.0) == HandIn(answered=[(second, MULTI_REQUEST_SEQUENCE)], released=[second])
    assert model.admitted == [] and model.resumed == []


def test_a_request_the_driver_ended_while_triton_held_it_is_let_go_and_released_unanswered_when_handed_back():
    model = held_by_triton()
    model.open_ids.discard("r7")  # not handed back within the idle time: the driver's reaper ended it (DROPPED)
    assert model.book.hold(Output("r7", finished=True)) is False  # sent at once: no execute() is running

    other = new(8)
    model.hand_in(other, now=31.0)
    assert model.hand_back("r8", now=31.5) == HandBack(rescheduled=[other])
    assert model.book.let_go == {7: 31.5} and model.book.request_ids == {8: "r8"}

    late = again(7)  # Triton hands it back after all
    assert model.hand_in(late, now=32.0) == HandIn(released=[late], gap=0.5)
    assert model.resumed == [] and model.book.let_go == {}


def test_a_request_the_step_reaped_as_dropped_gets_its_error_when_the_step_is_done():
    """The driver reaps inside an execute() too: a request Triton has not handed back for the idle time (Triton let go
    of it; the model still holds its sender) gets its final error at the step's end, not never."""
    model = held_by_triton()
    other = new(8)
    model.hand_in(other, now=31.0)
    dropped = model.make("r7", finished=True)  # the step's reaper ended it with DROPPED: held, as every output is
    made = model.make("r8")
    assert model.hand_back("r8", now=31.5) == HandBack(rescheduled=[other], send=[dropped])
    assert model.book.let_go == {7: 31.5} and model.book.unsent == {"r8": [made]}


def test_a_request_ended_between_executes_and_handed_back_before_the_book_saw_it_is_released():
    model = held_by_triton()
    model.open_ids.discard("r7")  # the reaper ended it and its final response went out
    model.closed_senders.add("r7")
    late = again(7)
    assert model.hand_in(late, now=31.0) == HandIn(released=[late], gap=30.5)
    assert model.resumed == ["r7"] and model.book.request_ids == {}
    assert model.hand_back(now=31.5) == HandBack() and model.book.let_go == {}


def test_a_new_sequence_under_a_let_go_correlation_id_is_admitted():
    model = Model()
    model.hand_in(new(7), now=0.0)
    model.hand_back("r7", now=0.5)
    model.open_ids.discard("r7")  # ended while Triton held it
    model.hand_in(new(8), now=1.0)
    model.hand_back("r8", now=1.5)
    assert model.book.let_go == {7: 1.5}
    reused = new(7)  # Triton's numbering, or a client, starts a sequence under that id again
    assert model.hand_in(reused, now=2.0) == HandIn(handed={"r7": reused})
    assert model.admitted == ["r7", "r8", "r7"] and model.book.let_go == {}


def test_a_failure_releases_the_requests_of_the_step_and_lets_go_of_those_triton_holds():
    model = Model()
    first, second = new(7), new(8)
    model.hand_in(first, second, now=0.0)
    model.hand_back("r7", "r8", now=0.5)
    stepped = again(7)
    model.hand_in(stepped, now=1.0)  # Triton ran a subset: r8 waits in its queue
    errors = [model.make("r7", finished=True)]
    model.open_ids.clear()  # the driver ended every open request (engine_failed); r8's error went out unsent
    assert model.hand_back(now=1.5) == HandBack(released=[stepped])
    assert model.book.let_go == {8: 1.5} and model.book.request_ids == {}
    assert model.book.returned() is True and model.book.take_released() == errors


def test_let_go_and_cancelled_by_client_are_forgotten_after_twice_the_idle_time():
    model = Model()
    first, second = new(7), new(8)
    model.hand_in(first, second, now=0.0)
    model.hand_back("r7", "r8", now=0.5)
    cancelled = again(7)  # Triton ran a subset: r8 waits in its queue
    model.hand_in(cancelled, now=5.0)
    final = model.make("r7", finished=True)
    model.cancelled_clients.add("r7")
    model.open_ids.discard("r8")  # the driver's reap during the step: not handed back within the idle time
    assert model.hand_back(now=10.0) == HandBack(rescheduled=[cancelled], forgotten=[final])
    assert model.book.cancelled_by_client == {7: 10.0} and model.book.let_go == {8: 10.0}

    model.hand_in(new(9), now=10.0 + 2 * REAP_AFTER - 0.5)
    model.hand_back("r9", now=10.0 + 2 * REAP_AFTER - 0.5)
    assert model.book.cancelled_by_client == {7: 10.0} and model.book.let_go == {8: 10.0}  # still remembered
    model.hand_in(again(9), now=10.0 + 2 * REAP_AFTER)
    model.hand_back("r9", now=10.0 + 2 * REAP_AFTER)
    assert model.book.cancelled_by_client == {} and model.book.let_go == {}

    late_cancelled, late_let_go = again(7), again(8)
    plan = model.hand_in(late_cancelled, late_let_go, now=71.0)
    assert plan.answered == [(late_cancelled, MULTI_REQUEST_SEQUENCE), (late_let_go, MULTI_REQUEST_SEQUENCE)]
    assert plan.released == [late_cancelled, late_let_go] and model.resumed == ["r7", "r9"]  # not 7 or 8 again


def test_a_preempted_request_stays_unfinished_and_is_handed_back_as_is_one_triton_left_out():
    model = Model()
    first, second = new(7), new(8)
    model.hand_in(first, second, now=0.0)
    token = model.make("r8")  # r7 was preempted: no output, still open in the driver
    assert model.hand_back("r7", "r8", now=0.5) == HandBack(rescheduled=[first, second])
    assert model.asked == [[]]

    preempted = again(7)  # Triton ran a subset: r8 waits in its queue, still open, its token still held
    assert model.hand_in(preempted, now=1.0) == HandIn(handed={"r7": preempted}, gap=0.5)
    assert model.hand_back("r7", now=1.5) == HandBack(rescheduled=[preempted])
    assert model.book.request_ids == {7: "r7", 8: "r8"} and model.book.let_go == {}

    waited = again(8)
    assert model.hand_in(waited, now=2.0) == HandIn(handed={"r8": waited}, send=[token], gap=0.5)


def test_a_request_that_ends_its_clients_sequence_is_relayed_and_released_and_its_copy_admitted():
    model = Model()
    client = SequenceRequest(None, ends_client_sequence=True, request="START and END")
    assert model.hand_in(client, now=0.0) == HandIn(relayed=[client], released=[client])
    assert model.admitted == [] and model.book.request_ids == {}
    assert model.hand_back(now=0.1) == HandBack()
    assert model.book.returned() is False

    copy = SequenceRequest(FIRST_RELAY_ID, start=True, request="the relay's copy")  # Triton batches it like any other
    assert model.hand_in(copy, now=0.2) == HandIn(handed={f"r{FIRST_RELAY_ID}": copy})


def test_a_request_ended_as_cancelled_while_triton_held_it_gives_its_sequence_to_close():
    """Triton answered it, and may keep its slot: the model closes the sequence with a request of its own, which the
    book answers (a bare final) and releases for good; the request is let go of, not asked about again."""
    model = held_by_triton()
    model.hand_in(new(8), now=1.0)
    model.hand_back("r8", now=1.5)
    model.book.returned()
    model.open_ids.discard("r7")  # the driver's reaper ended it: its client cancelled it while Triton held it
    assert model.book.close_sequences(["r7"], now=6.0) == [7]
    assert model.book.request_ids == {8: "r8"} and model.book.let_go == {7: 6.0}
    assert model.book.close_sequences(["r7"], now=7.0) == []  # once

    closing = SequenceRequest(7, start=True, closes=True, request="the model's own")
    waited = again(8)
    assert model.hand_in(closing, waited, now=7.5) == HandIn(closed=[closing], released=[closing],
                                                             handed={"r8": waited}, gap=6.0)
    assert model.admitted == ["r7", "r8"]  # not admitted to the engine
    assert model.hand_back("r8", now=8.0) == HandBack(rescheduled=[waited])


def test_a_closing_request_for_a_sequence_triton_had_ended_is_answered_the_same_way():
    model = Model()
    closing = SequenceRequest(12, start=True, closes=True, request="the model's own")
    assert model.hand_in(closing, now=0.0) == HandIn(closed=[closing], released=[closing])
    assert model.admitted == [] and model.book.request_ids == {}
