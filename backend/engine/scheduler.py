"""Decides, every step, how many tokens each request runs: vLLM v1's rule without prefill or decode phases.

Each request has ``num_computed_tokens`` (K/V in the cache) and ``num_tokens``; scheduling brings the first up to
the second within a token budget. A prompt, a prompt chunk, a decode and a resume after preemption are all that
rule. Pure Python: the model runner reads the returned :class:`SchedulerOutput` and never the queues.

The two ways of batching compared by this project (``EngineConfig.batching``) differ only in who may join the
running batch:

* ``continuous`` (in-flight batching): waiting requests are admitted every step, as soon as a slot, budget and KV
  blocks allow.
* ``run_to_completion``: when nothing is in flight, up to ``max_num_seqs`` requests at the head of the queue become
  the batch, and no newcomer joins until every member has finished (members that miss the budget or the KV cache
  join over the next steps; a preempted member goes back in). This is what Triton's dynamic batcher gives a
  generation model.
* ``iterative``: the caller names the requests of each step (``schedule(only=...)``: Triton's iterative sequence
  batcher). Only those run or are admitted; the others are not stepped and keep their blocks. The same rule
  (budget, chunks, preemption of the newest running request) applies within the named ones.

Who goes first is ``EngineConfig.scheduling_policy`` (vLLM's name):

* ``fcfs`` (the default): the waiting queue in arrival order, a preempted request back at its front; the running
  batch in admission order, the last admitted preempted first. A request's ``priority`` is ignored.
* ``priority``: both queues ordered by ``(priority, arrival)``, a lower value first (vLLM's direction). The head of
  the queue is the highest class, oldest first; the request preempted when seats or KV blocks run out is the last
  of the running order, the lowest class and latest arrived. A waiting request of a strictly higher class than the
  last running one takes its seat or its blocks (that one is preempted); a class never preempts its own or a higher
  one. NOTE: there is no ageing: under a steady stream of a higher class a lower class waits without bound (until
  its client gives up, or ``max_queue_size`` refuses newcomers). Priority decides who runs, never how fast.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from itertools import islice

from backend.contract.errors import PROMPT, ContextLengthExceeded, InvalidRequest
from backend.engine.block_manager import BlockManager
from backend.engine.config import EngineConfig
from backend.engine.request import FinishReason, Request, RequestStatus


def _queue_order(request: Request) -> tuple[int, float]:
    """The ``priority`` policy's order of both queues: a lower value first, then the earlier arrival."""
    return request.priority, request.timings.arrival


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """Run ``request.token_ids[c : c + num_new_tokens]`` at positions ``c..`` where ``c = num_computed_tokens``.

    ``samples`` is true when this step reaches the end of the sequence, so the runner must sample a token: computed
    here once, read by the runner and by :meth:`Scheduler.update`.
    """

    request: Request
    num_new_tokens: int
    samples: bool

    @classmethod
    def of(cls, request: Request, num_new_tokens: int) -> ScheduledRequest:
        return cls(request, num_new_tokens, request.num_computed_tokens + num_new_tokens == request.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # running requests first, then admitted ones
    num_batched_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    num_running: int = 0
    num_waiting: int = 0
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy on write, before the forward

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues; the engine calls ``schedule()``, runs the model, then ``update()``."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        """``config`` has its ``max_model_len`` (the engine passes its ``ResolvedConfig``)."""
        if config.max_model_len is None:
            raise ValueError("the scheduler needs max_model_len: pass EngineConfig.resolve()'s config")
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = config.max_model_len
        self.by_priority = config.scheduling_policy == "priority"
        self.waiting: deque[Request] = deque()  # FCFS, preempted ones at the front; or by (priority, arrival)
        self.running: list[Request] = []  # admission order, or by (priority, arrival): the last is preempted first
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self.current_batch_ids: set[str] = set()  # run_to_completion: unfinished members of the batch in flight
        self.num_preemptions = 0

    # ---- queues ---------------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; ``InvalidRequest`` (a ``ValueError`` that names the parameter to blame) if it could never
        run (the engine reports that to this request only).

        NOTE: how many may wait is the front door's limit (``EngineLoop.submit``, ``max_queue_size``), not this."""
        if request.request_id in self.requests:
            raise InvalidRequest(None, f"request id {request.request_id!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.block_ids:
            raise InvalidRequest(None, f"request {request.request_id!r} is not a new request")
        self._check_fits(request)
        self.requests[request.request_id] = request
        self._enqueue(request, preempted=False)

    def _enqueue(self, request: Request, preempted: bool) -> None:
        """Into the waiting queue: at the back (a preempted one at the front), or at its (priority, arrival)."""
        if self.by_priority:
            bisect.insort_right(self.waiting, request, key=_queue_order)
        elif preempted:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _check_fits(self, request: Request) -> None:
        """The one check of a request against max_model_len and the KV pool."""
        num_prompt = request.num_prompt_tokens
        if num_prompt >= self.max_model_len:
            raise ContextLengthExceeded(
                PROMPT,
                f"the prompt has {num_prompt} tokens but max_model_len is {self.max_model_len}, "
                "which leaves no room for a generated token; shorten the prompt"
            )
        pool = self.block_manager
        if pool.num_blocks_for(num_prompt) > pool.num_blocks:
            raise ContextLengthExceeded(
                PROMPT,
                f"the prompt has {num_prompt} tokens, more than the whole KV cache holds "
                f"({pool.num_blocks} blocks of {pool.block_size} tokens); shorten the prompt"
            )
        # NOTE: a request alone in the pool must be able to reach its end, or it would preempt itself forever.
        # The last sampled token needs no K/V, hence the -1.
        max_tokens = request.sampling_params.max_tokens
        max_len = self.max_model_len if max_tokens is None else min(num_prompt + max_tokens, self.max_model_len)
        if pool.num_blocks_for(max_len - 1) > pool.num_blocks:
            raise ContextLengthExceeded(
                "max_tokens",
                f"the request may grow to {max_len} tokens (prompt + max_tokens, capped by max_model_len), more "
                f"than the whole KV cache holds ({pool.num_blocks} blocks of {pool.block_size} tokens); "
                "lower max_tokens"
            )
        # A forked group is preempted and resumed whole, so all n of its sequences must fit in the pool at once.
        n = request.sampling_params.n
        if n > 1 and n * pool.num_blocks_for(max_len - 1) > pool.num_blocks:
            raise ContextLengthExceeded(
                "n",
                f"n={n} sequences of up to {max_len} tokens each need more than the whole KV cache holds "
                f"({pool.num_blocks} blocks of {pool.block_size} tokens); lower n or max_tokens"
            )

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """Finish a request from outside the step (abort, stop string, a failed step) and free its blocks now;
        ``None`` if it is unknown or done."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, reason)
        return request

    def add_forked(self, parent: Request, children: list[Request]) -> None:
        """Run ``children``, new sequences of the running ``parent``'s prompt that each hold their first token, once
        this step has computed the parent's prompt (parallel sampling, backend/engine/parallel_sampling.py). They
        take references on the parent's blocks and run right after it: a group keeps its parent's age."""
        at = self.running.index(parent) + 1
        for child in children:
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_tokens
            child.status = RequestStatus.RUNNING
            child.timings.first_scheduled = parent.timings.first_scheduled
            child.timings.first_token = time.perf_counter()
            self.requests[child.request_id] = child
            if parent.request_id in self.current_batch_ids:
                self.current_batch_ids.add(child.request_id)
        self.running[at:at] = children
        for child in children:
            reason = child.check_stop(self.max_model_len)
            if reason is not None:
                self.finish(child.request_id, reason)

    def preempt(self, request_id: str) -> None:
        """Preempt a running request between steps (the rest of a forked group whose member was preempted)."""
        request = self.requests.get(request_id)
        if request is not None and request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._preempt(request)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Mark finished and release everything; the caller removes it from its queue."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.timings.finished = time.perf_counter()
        self.block_manager.free(request)
        del self.requests[request.request_id]
        self.current_batch_ids.discard(request.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- the step -------------------------------------------------------------------------------------------

    def schedule(self, only: Collection[str] | None = None) -> SchedulerOutput:
        """Pick this step's tokens: running requests first (in running order: oldest, or highest class, first), then
        admissions from the queue. With ``only``, just the requests it names run or are admitted (the others wait,
        keeping their blocks); a preemption may still hit any running request, the last in running order first.

        ``request.num_computed_tokens`` stays where it was until :meth:`update`, so the runner reads it as the
        first position to run.
        """
        output = SchedulerOutput()
        budget = self._schedule_running(output, self.config.max_num_batched_tokens, only)
        # A step that had to preempt is out of blocks: admitting now would only preempt again.
        if not output.preempted_ids:
            self._schedule_waiting(output, budget, only)
        output.num_batched_tokens = sum(s.num_new_tokens for s in output.scheduled)
        output.num_running = len(self.running)
        output.num_waiting = len(self.waiting)
        output.blocks_to_copy = self.block_manager.take_blocks_to_copy()
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int, only: Collection[str] | None) -> int:
        """Decodes and unfinished prompt chunks in running order; preempts the last when blocks run out."""
        chunked = self.config.enable_chunked_prefill
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if only is not None and request.request_id not in only:
                i += 1
                continue
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new > budget:
                if not chunked:  # the rest of a prompt runs whole or waits; later decodes may still fit
                    i += 1
                    continue
                num_new = budget
            while self.block_manager.allocate_slots(request, num_new) is None:
                victim = self.running.pop()  # never an already-scheduled one: those sit before index i
                self._preempt(victim)
                output.preempted_ids.append(victim.request_id)
                if victim is request:
                    return budget
            output.scheduled.append(ScheduledRequest.of(request, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, output: SchedulerOutput, budget: int, only: Collection[str] | None) -> None:
        """Admit from the head of the queue (its order, never skipping it) while seats, budget and blocks allow;
        with ``only``, the head of the named ones; under ``priority``, a head of a higher class may take the seat or
        the blocks of the last running request (:meth:`_preempt_for`)."""
        fixed_batch = self.config.batching == "run_to_completion"
        if fixed_batch and not self.current_batch_ids:
            # Nothing in flight: the next batch is the head of the queue, fixed until all of it finishes.
            self.current_batch_ids = {r.request_id for r in islice(self.waiting, self.config.max_num_seqs)}
        names = self.current_batch_ids if fixed_batch else only
        if fixed_batch and only is not None:
            names = names & set(only)
        candidates = self.waiting if names is None else deque(r for r in self.waiting if r.request_id in names)
        made_room = False
        while candidates and budget > 0:
            request = candidates[0]
            if len(self.running) >= self.config.max_num_seqs:
                freed = self._preempt_for(request, output)
                if freed is None:
                    break
                budget, made_room = budget + freed, True
                continue
            num_cached = self.block_manager.get_computed_blocks(request)
            request.num_computed_tokens = num_cached
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    self._undo_admission(request)
                    break
                num_new = budget
            if self.block_manager.allocate_slots(request, num_new) is None:
                self._undo_admission(request)
                freed = self._preempt_for(request, output)
                if freed is None:
                    break
                budget, made_room = budget + freed, True
                continue
            candidates.popleft()
            if candidates is not self.waiting:
                self.waiting.remove(request)
            if self.by_priority:
                bisect.insort_right(self.running, request, key=_queue_order)
            else:
                self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_cached_tokens = num_cached
            if request.timings.first_scheduled is None:
                request.timings.first_scheduled = time.perf_counter()
            output.scheduled.append(ScheduledRequest.of(request, num_new))
            budget -= num_new
            if made_room:
                break  # what was freed for this request must not go to a lower class than the one preempted

    def _preempt_for(self, request: Request, output: SchedulerOutput) -> int | None:
        """Under ``priority``: preempt the last running request (lowest class, latest arrived) when ``request`` is of
        a strictly higher class, giving back what it was scheduled for this step; returns the token budget it gave
        back, or None when nobody may be preempted for ``request`` (a class never preempts its own or a higher one).

        NOTE: the victim is never one admitted in this step: those came from the queue's head, of a class as high as
        ``request``'s or higher."""
        if not self.by_priority or not self.running or self.running[-1].priority <= request.priority:
            return None
        victim = self.running.pop()
        freed = 0
        for i, scheduled in enumerate(output.scheduled):
            if scheduled.request is victim:
                freed = scheduled.num_new_tokens
                del output.scheduled[i]
                break
        self._preempt(victim)
        output.preempted_ids.append(victim.request_id)
        return freed

    def _undo_admission(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop its K/V; it resumes from the front of the queue (of its class, under
        ``priority``) with its tokens intact."""
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, preempted=True)

    def update(self, output: SchedulerOutput, sampled_token_ids: dict[str, int]) -> list[Request]:
        """Apply a finished step; returns the requests that got a token (finished ones included).

        ``sampled_token_ids`` maps the id of every scheduled request with ``samples`` to its new token.
        """
        outputs = []
        any_finished = False
        for scheduled in output.scheduled:
            request = scheduled.request
            if request.is_finished:  # aborted after schedule(): its blocks are gone already
                continue
            request.num_computed_tokens += scheduled.num_new_tokens
            self.block_manager.cache_full_blocks(request)
            if not scheduled.samples:
                continue
            request.append_token(sampled_token_ids[request.request_id])
            if request.timings.first_token is None:
                request.timings.first_token = time.perf_counter()
            reason = request.check_stop(self.max_model_len)
            if reason is not None:
                self._finish(request, reason)
                any_finished = True
            outputs.append(request)
        if any_finished:  # one pass instead of list.remove per finished request
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    # ---- capacity -------------------------------------------------------------------------------------------

    def max_concurrency_by_kv(self, tokens_per_seq: int) -> int:
        """How many sequences of ``tokens_per_seq`` tokens the KV pool holds at once (before max_num_seqs)."""
        if tokens_per_seq <= 0:
            raise ValueError(f"tokens_per_seq must be positive; got {tokens_per_seq}")
        return self.block_manager.num_blocks // self.block_manager.num_blocks_for(tokens_per_seq)
