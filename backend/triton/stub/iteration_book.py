"""What Triton 2.51's iterative sequence batcher lets llm_iterative do with the requests it hands in, kept as a state
machine without I/O: :class:`IterationBook`.

The model's ``execute()`` (model_repository/llm_iterative/1/model.py) reads each request's sequence controls, hands
them in, and carries out what the book decides: which requests to relay, to answer with an error, to give the driver
(``IterationDriver``, backend/engine/batching.py) for this iteration's engine step, to hand back
(RELEASE_RESCHEDULE) or to release for good (RELEASE_ALL); which outputs to send now, which to hold, and which to
close without sending. The model owns the threads, the lock and every ``pb_utils`` call; the book owns the rules:

Client sequences. perf_analyzer and genai-perf send a sequence model sequences of their own: a correlation id, START
on the first request, END on the last (``--sequence-length``, 20 by default). A request that carries START and END
(one request per sequence) cannot be handed back in Triton 2.51; ``SequenceRelay`` serves it through a copy without
the client's sequence, which Triton batches like any other. A sequence of several requests cannot be served:
releasing its first request closes it in Triton 2.51, which then refuses the third itself; the second, which would
otherwise wait for ever, is answered at once with an error that says what to send instead
(``MULTI_REQUEST_SEQUENCE``).

Cancellations. Where a client's cancel finds its request decides what happens to the sequence's slot (Triton 2.51's
sequence batcher: ``IterativeSequencer::RescheduleRequest`` in triton-inference-server/core's
src/sequence_batch_scheduler/sequence_utils.cc):
- while the model holds the request: the driver ends it after the step (``IterationDriver.iterate``) and the model
  hands it back (RELEASE_RESCHEDULE); Triton, queueing it again, finds it cancelled, answers it itself (CANCELLED)
  and frees the slot at once;
- released for good (RELEASE_ALL): Triton frees the slot by queueing an END of its own, but only for a request not
  cancelled by then. A cancelled request released for good keeps its slot until Triton's idle reaper
  (max_sequence_idle_microseconds) frees it, so the book never releases one for good: it is handed back. A cancel
  can still come after the book's last look and before Triton has carried out the release: execute() returning and
  Triton releasing are two steps, and under load the second came more than SEND_AFTER_RELEASE_S after the first.
  A client that cancels once it has its final response (tritonclient's ``stop_stream(cancel_requests=True)``) lands
  there whenever its final response went out before Triton released the request (``make soak``'s
  fresh_stream_cancel_after_final left slots taken). So the final responses of released requests wait for the next
  execute(), which Triton calls only once it has released them, when one is coming (requests were handed back);
  only when none is do they go out SEND_AFTER_RELEASE_S after the return, a window left open: closing those
  sequences on a guess is not safe, as a client's own sequence ids come back (perf_analyzer reuses them), and a
  request that starts a sequence under a live id ends that sequence;
- in the queue that forms the next batch: Triton answers it, and the slot stays taken until the idle reaper, unless
  the model closes the sequence. Once the driver has ended such a request (not handed back within CANCELLED_AFTER_S,
  its client having cancelled it), :meth:`IterationBook.close_sequences` gives its correlation id, and the model sends
  a request of its own that starts a sequence under that id (``SequenceRelay.close_sequence``): Triton ends the old
  sequence, gives the slot to the new request, and frees it when execute() has answered and released it
  (``HandIn.closed``). A burst of clients that cancel within a few hundred milliseconds of sending left most of the
  8 slots taken this way; only the idle reaper freed them.
  With every slot taken, new requests wait in Triton's backlog, and one that waited longer than the idle time is
  ended by the reaper as soon as it gets a slot ("must specify the START flag" on the hand-back).

What is sent when. Clients cancel in answer to what they receive, so what an execute() makes for a request is sent
when the model holds it again (at the start of the next execute(), after the rebinds) or once Triton has released it
for good: at the start of the next execute(), or, when none comes sooner, SEND_AFTER_RELEASE_S after the return
(AWAIT_EXECUTE_S when requests were handed back, so one is coming: :meth:`IterationBook.send_wait`). Never while
Triton holds it: Triton may have answered it, and a send then crashes tritonserver 2.51
(triton_workarounds.NO_SEND_WHILE_TRITON_HOLDS). A request that ends in an execute() and whose client has cancelled
it is handed back instead of released, what it made dropped, for Triton to answer. What remains,
a cancel in the few milliseconds between a release and the next batch, costs that slot until the model closes the
sequence (CANCELLED_AFTER_S to twice that).

Requests not handed back. Triton hands every request it holds back at its next iteration. One not handed back is
ended and its KV blocks freed (``IterationDriver``): if its client cancelled it while Triton held it, after
CANCELLED_AFTER_S: Triton answered it itself and nothing is sent (a second final response crashes tritonserver 2.51);
otherwise, after max_sequence_idle_microseconds, Triton dropped it, and its client gets an error that says the server
lost it, whether the driver's reaper or an execute()'s step ended it (then at the step's end: ``HandBack.send``). The
book remembers such a request as let go (and one handed back cancelled as cancelled by its client) for
twice the idle time, so that Triton handing it back after all is told apart from a client's next request.

The idle time. Triton 2.51 counts a sequence's idle time from its last request's arrival, and time in the backlog
counts: a request that waited there longer than max_sequence_idle_microseconds is force-ended as soon as it gets a
slot (so is one whose iteration took that long). The idle time (config.pbtxt) is therefore 10 minutes, as long as
OpenAI's Python client waits for an answer by default: it bounds the backlog's wait, and the slots that cancels leave
taken are freed by the model's closing requests, not by the reaper. (At 30 s, 64 streams on the 8 slots of a 2-core
AMD EPYC failed 98 of 256 requests that waited in the backlog; at 5 s, 16 streams on a slow 2-core machine lost some.)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from backend.triton.stub.sequence_relay import CANCELLED, MULTI_REQUEST_SEQUENCE

# Time from execute()'s return to sending what the requests it released for good made, when no execute() comes
# sooner (the module's docstring): when it handed none back (no execute() is coming), and when it handed some back.
SEND_AFTER_RELEASE_S = 0.005
AWAIT_EXECUTE_S = 0.05
# How long a request its client cancelled may go without being handed back before its KV blocks are freed: Triton
# answered it itself. Shorter than Triton's idle time (config.pbtxt), which bounds the backlog's wait instead.
CANCELLED_AFTER_S = 5.0


class Output(Protocol):
    """What the book reads of an engine output (``RequestOutput``)."""

    request_id: str
    finished: bool


@dataclass(frozen=True, eq=False)
class SequenceRequest:
    """One request Triton handed to execute(): its sequence controls, and Triton's request object, which the book
    never touches and only returns in its decisions."""

    correlation_id: int | None  # CORRID (a request that ends its client's sequence carries its client's)
    start: bool = False  # START: the first request of its sequence
    ends_client_sequence: bool = False  # its client's END flag: served through the relay (the module's docstring)
    closes: bool = False  # the model's own request that closes a sequence (SequenceRelay.close_sequence)
    request: Any = None


@dataclass
class HandIn:
    """What to do with an execute()'s requests before the engine step."""

    relayed: list[SequenceRequest] = field(default_factory=list)  # forward through ``SequenceRelay``
    # The model's own requests that close a sequence: answered with a bare final response once released for good
    closed: list[SequenceRequest] = field(default_factory=list)
    answered: list[tuple[SequenceRequest, str]] = field(default_factory=list)  # answer with this final error
    # RELEASE_ALL now: the relayed, the answered, and those that got their final response (or never needed one)
    released: list[SequenceRequest] = field(default_factory=list)
    handed: dict[str, SequenceRequest] = field(default_factory=dict)  # engine request id -> request, for the step
    send: list[Output] = field(default_factory=list)  # to send now, before the step
    gap: float | None = None  # the hand-back's cost: from the last execute()'s end to this one's start


@dataclass
class HandBack:
    """What to do with the requests the engine step ran, once it is done."""

    rescheduled: list[SequenceRequest] = field(default_factory=list)  # RELEASE_RESCHEDULE
    released: list[SequenceRequest] = field(default_factory=list)  # RELEASE_ALL
    forgotten: list[Output] = field(default_factory=list)  # final outputs to close without sending: Triton answers
    # Final outputs the step made for requests Triton dropped (the driver reaped them: not handed in, Triton let go of
    # them and the model still holds their senders), to send now, as the reaper's own answers are between executes.
    send: list[Output] = field(default_factory=list)


class IterationBook:
    """Which requests Triton holds, which the model holds, and what may be sent to each (the module's docstring).

    One execute() is ``hand_in()`` → the driver's step over ``HandIn.handed`` → ``hand_back()`` → ``returned()``.
    From ``hand_in()`` to ``returned()`` every output is held (:meth:`hold`); outside, outputs go out at once (the
    driver's reaper answers requests Triton dropped). ``is_open`` is the driver's: whether it still has the request
    (it ends one for good with its final output). Not thread-safe: the model calls it under its one lock.
    """

    def __init__(self, reap_after: float, is_open: Callable[[str], bool]) -> None:
        self.reap_after = reap_after  # Triton's idle time (max_sequence_idle_microseconds), seconds
        self._is_open = is_open
        self.request_ids: dict[int, str] = {}  # Triton's correlation id -> engine request id, while the request is open
        # Correlation ids whose request the driver ended while Triton held it (reaped, or every request ended by a
        # failure): Triton may still hand it back, and it must then be released unanswered. -> when
        self.let_go: dict[int, float] = {}
        # Correlation ids of requests handed back because their client cancelled them (Triton answers them) -> when
        self.cancelled_by_client: dict[int, float] = {}
        # What an execute() made, sent once Triton holds those requests again or has released them (the module's
        # docstring): in the next execute(), or when none comes sooner once IterationBook.send_wait says so.
        self.in_execute = False
        self.unsent: dict[str, list[Output]] = {}  # request id -> outputs an execute() made for it, not sent yet
        # Requests released for good: what they made may be sent once Triton has carried out the release (the
        # module's docstring). NOTE: a dict, for the order of sends.
        self.released: dict[str, None] = {}
        self.released_at: float | None = None  # when the last execute() that handed requests back returned
        self.returned_at = 0.0  # when the last execute() ended its step
        self._handed: dict[str, SequenceRequest] = {}  # this execute()'s requests for the step

    def hold(self, output: Output) -> bool:
        """The driver made ``output``: during an execute() it is held until it may be sent (true); outside one, the
        caller sends it now (false)."""
        if not self.in_execute:
            return False
        self.unsent.setdefault(output.request_id, []).append(output)
        return True

    def hand_in(
        self,
        requests: Iterable[SequenceRequest],
        now: float,
        admit: Callable[[SequenceRequest], str | None],
        resume: Callable[[str, SequenceRequest], bool],
    ) -> HandIn:
        """An execute() begins with ``requests`` at ``now``. ``admit`` opens a new one (START) and hands it to the
        driver: its request id, or None once it got its final error. ``resume(request_id, request)`` binds a
        rescheduled one to its new response sender: false if it is no longer open (its final response went out)."""
        self.in_execute = True
        plan = HandIn()
        self._handed = {}
        for item in requests:
            if item.closes:  # the model's own (close_sequences): released for good, Triton then frees its slot
                plan.closed.append(item)
                plan.released.append(item)
                continue
            if item.ends_client_sequence:
                plan.relayed.append(item)
                plan.released.append(item)
                continue
            correlation_id = item.correlation_id
            if correlation_id in self.cancelled_by_client:
                # Triton answers a cancelled request it finds in its queue; if it hands one back instead, it is the
                # model's to answer.
                del self.cancelled_by_client[correlation_id]
                plan.answered.append((item, CANCELLED))
                plan.released.append(item)
                continue
            if item.start:
                self.let_go.pop(correlation_id, None)
                request_id = admit(item)
            elif correlation_id not in self.request_ids and correlation_id not in self.let_go:
                # NOTE: not a hand-back (none of ours is open under this id): the next request of its client's own
                # sequence, after the one before it got its final response.
                plan.answered.append((item, MULTI_REQUEST_SEQUENCE))
                plan.released.append(item)
                continue
            else:  # rescheduled; unknown once the driver ended it (its final response went out then)
                if self.released_at is not None:  # the hand-back: the last execute()'s end to this one's start
                    plan.gap = now - self.released_at
                    self.released_at = None
                self.let_go.pop(correlation_id, None)
                request_id = self.request_ids.get(correlation_id)
                if request_id is not None and not resume(request_id, item):
                    request_id = None
            if request_id is None or not self._is_open(request_id):  # it got its final response
                self.request_ids.pop(correlation_id, None)
                if request_id is not None:
                    self.released[request_id] = None
                plan.released.append(item)
            else:
                self.request_ids[correlation_id] = request_id
                self._handed[request_id] = item
        plan.handed = dict(self._handed)

        # Triton released the last execute()'s requests before it called this one, and those handed back are
        # bound to their new senders: what it made goes out now, while they are in the model's hands again.
        plan.send = self._take([*self.released, *self._handed])
        self.released.clear()
        # What was made for a request Triton no longer hands back (the driver ended it) is never sent.
        self.unsent = {rid: outputs for rid, outputs in self.unsent.items() if self._is_open(rid)}
        return plan

    def hand_back(
        self,
        unfinished: Collection[str],
        client_cancelled: Callable[[Collection[str]], Iterable[str]],
        now: float,
    ) -> HandBack:
        """The driver's step is done at ``now``: ``unfinished`` are the requests to reschedule (the driver's
        answer). ``client_cancelled`` says which of the requests that ended (their final response not sent yet)
        their clients cancelled: what they made is dropped, and they are handed back rather than released, for
        Triton to answer (the module's docstring)."""
        plan = HandBack()
        ended = [rid for rid in self._handed if rid not in unfinished and rid in self.unsent]
        cancelled = set(client_cancelled(ended))
        for request_id in ended:
            if request_id in cancelled:
                plan.forgotten += [output for output in self.unsent.pop(request_id) if output.finished]
        for request_id, item in self._handed.items():
            if request_id in unfinished:
                plan.rescheduled.append(item)
            elif request_id in cancelled:
                self.request_ids.pop(item.correlation_id, None)
                self.cancelled_by_client[item.correlation_id] = now
                plan.rescheduled.append(item)
            else:
                self.request_ids.pop(item.correlation_id, None)
                self.released[request_id] = None
                plan.released.append(item)
        dropped = [rid for rid in self.unsent if rid not in self._handed and not self._is_open(rid)]
        plan.send = [output for request_id in dropped for output in self.unsent.pop(request_id)]
        self._handed = {}
        # Requests the driver ended while Triton held them (reaped: Triton let go of them; or a failure) are
        # forgotten, and remembered as let go until Triton's own idle timeout has surely ended their sequences.
        for correlation_id, request_id in list(self.request_ids.items()):
            if not self._is_open(request_id):
                del self.request_ids[correlation_id]
                self.let_go[correlation_id] = now
        self.let_go = {c: t for c, t in self.let_go.items() if now - t < 2 * self.reap_after}
        self.cancelled_by_client = {c: t for c, t in self.cancelled_by_client.items() if now - t < 2 * self.reap_after}
        self.released_at = now if unfinished else None
        self.returned_at = now
        return plan

    def close_sequences(self, request_ids: Collection[str], now: float) -> list[int]:
        """The driver ended ``request_ids`` because their clients cancelled them while Triton held them: Triton
        answered each itself and, if the cancel found it in the queue that forms the next batch, keeps its sequence
        slot until the idle reaper. Returns their correlation ids, for the model to close each sequence with a request
        of its own (``SequenceRelay.close_sequence``), which :meth:`hand_in` answers and releases for good."""
        ended = set(request_ids)
        correlation_ids = [c for c, rid in self.request_ids.items() if rid in ended]
        for correlation_id in correlation_ids:
            del self.request_ids[correlation_id]
            self.let_go[correlation_id] = now
        return correlation_ids

    def returned(self) -> bool:
        """execute() returns: outputs go out at once again. True when requests were released for good: what they
        made goes out with :meth:`take_released` once :meth:`send_wait` says so, unless an execute() comes sooner."""
        self.in_execute = False
        return bool(self.released)

    def send_wait(self, now: float) -> float:
        """Seconds from ``now`` until the sender may take what the released requests made (0: now): from the last
        step's end, SEND_AFTER_RELEASE_S, or AWAIT_EXECUTE_S when it handed requests back, for the next execute()
        comes then and sends it once Triton has released them (the module's docstring)."""
        wait = AWAIT_EXECUTE_S if self.released_at is not None else SEND_AFTER_RELEASE_S
        return max(0.0, self.returned_at + wait - now)

    def take_released(self) -> list[Output]:
        """What was made for the requests released for good, to send now (the sender thread, finalize)."""
        outputs = self._take(self.released)
        self.released.clear()
        return outputs

    def _take(self, request_ids: Iterable[str]) -> list[Output]:
        """NOTE: only for requests the model holds or Triton released: to one Triton holds, a send may reach a
        request Triton answered (a client's cancel) and freed what a send uses."""
        return [output for request_id in request_ids for output in self.unsent.pop(request_id, ())]
