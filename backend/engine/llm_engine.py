"""The engine: one step = schedule → run the model → sample → update → emit outputs.

``LLMEngine`` is single-threaded and synchronous (offline ``generate`` uses it as is); ``backend.engine.batching``
drives it for the server: a batch run to completion, or the engine's own loop thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from backend.contract import errors
from backend.contract.errors import PROMPT, ErrorKind, InvalidRequest
from backend.engine.block_manager import BlockManager
from backend.engine.config import EngineConfig
from backend.engine.detokenizer import IncrementalDetokenizer
from backend.engine.model_runner import ModelRunner, PromptRows
from backend.engine.openmp import check_wait_policy
from backend.engine.parallel_sampling import Fork, SequenceGroups
from backend.engine.request import FinishReason, Request, RequestTimings
from backend.engine.sampler import Sampler, TokenLogprobs, prompt_token_logprobs
from backend.engine.sampling_params import SamplingParams
from backend.engine.scheduler import Scheduler
from backend.engine.shared_cores import SharedCores
from backend.engine.stats import EngineStats, StepTimes
from backend.engine.structured_output import StructuredOutputs
from backend.engine.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability, its rank in the distribution it was drawn from, and its text (vLLM's ``Logprob``)."""

    logprob: float
    rank: int
    decoded_token: str


@dataclass
class RequestOutput:
    """What one step produced for one sequence of a request: the text and token ids new since its last output. A
    sequence's last output has its ``finish_reason``; the request's last output is ``finished`` (with ``n`` > 1,
    the last sequence's: backend/engine/parallel_sampling.py)."""

    request_id: str
    delta_text: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # a FinishReason value, on the sequence's last output
    index: int = 0  # the sequence's index among the request's n (OpenAI's choices[i].index)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    timings: RequestTimings | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at the sequence's last admission
    error: str | None = None  # on a final output that failed: the message its client gets (backend/contract/errors.py)
    # One per new token when the request asks (``SamplingParams.logprobs``): the sampled token's, then the likeliest.
    logprobs: list[dict[int, Logprob]] | None = None
    # vLLM's: one per prompt token when the request asks (``SamplingParams.prompt_logprobs``), in the same shape (the
    # prompt token's, then the likeliest), the first None; in the request's first output only (sequence 0's).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(frozen=True)
class EngineSnapshot:
    """What a server may read about the engine between steps (metrics, cancellation checks)."""

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_steps: int
    running_request_ids: tuple[str, ...]
    num_engines_busy: int = 1  # engines sharing the cores at the last forward, this one included (shared_cores.py)


@dataclass
class CompletionOutput:
    """A whole generation, as returned by :meth:`LLMEngine.generate`: all its text and token ids."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    timings: RequestTimings
    num_preemptions: int = 0
    delta_texts: list[str] = field(default_factory=list)  # the text as it was streamed, one delta per output
    index: int = 0  # which of its prompt's n completions


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        # NOTE: the one place the config is resolved against the model (config.json read once); every part reads this.
        self.config = config = config.resolve()
        check_wait_policy()
        self.tokenizer = load_tokenizer(config.model)
        self.runner = ModelRunner(config)
        # NOTE: a GPU's forward needs no share of the CPU's cores.
        self.cores = SharedCores.for_engine(self.runner.num_threads or 1,
                                            config.core_sharing if self.runner.num_threads else "off")
        capacity = self.runner.num_kv_blocks * config.block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"the KV pool holds {capacity} tokens, fewer than max_model_len ({self.max_model_len}): one long "
                "sequence could never finish; give the KV cache more memory or lower max_model_len"
            )
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.sampler = Sampler(config.seed)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.structured = StructuredOutputs(self.tokenizer.hf, config.model_shape.vocab_size, self.eos_token_ids,
                                            self.runner.num_threads or 1)
        self.stats = EngineStats()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}  # by sequence id
        # prompt_logprobs computed so far, one per prompt position from 0, by request id (until its first output)
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        self.groups = SequenceGroups()  # requests with n > 1
        self._ids = itertools.count()
        # Test-only: called with the step's requests before the forward; raising simulates a failing step.
        self.fault_hook: Callable[[list[Request]], None] | None = None

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ---- requests -------------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Request:
        """Tokenize and queue a request. Raises ``InvalidRequest`` (a ``ValueError``, for this request only) when it
        cannot be served. ``priority``: vLLM's, a lower value served earlier (read under ``scheduling_policy``
        ``priority`` only)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if "\x00" in request_id:  # the separator of a forked sequence's id (parallel_sampling.sequence_id)
            raise InvalidRequest(None, "a request id may not contain a NUL character")
        params = params or SamplingParams()
        params.check_token_ids(self.config.model_shape.vocab_size)
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise InvalidRequest(PROMPT, "the prompt is empty: it encodes to zero tokens")
        request = Request(request_id, token_ids, params, self.eos_token_ids, arrival_time, priority)
        if params.structured_outputs is not None:
            self.structured.add(request_id, params.structured_outputs)  # an invalid schema is refused here
        try:
            self.scheduler.add_request(request)  # refuses what can never fit: max_model_len, the KV pool
        except Exception:
            self.structured.forget(request_id)
            raise
        self._add_detokenizer(request)
        self.groups.add(request)
        return request

    def _add_detokenizer(self, request: Request) -> None:
        params = request.sampling_params
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer.hf, request.prompt_token_ids, params.stop, params.min_tokens,
            params.include_stop_str_in_output, params.skip_special_tokens,
        )

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> RequestOutput | None:
        """Stop a request (all its sequences) now and free its KV blocks; returns its final output, or None if it
        is unknown."""
        ended = [self.scheduler.finish(sid, reason) for sid in self.groups.sequence_ids(request_id)]
        outputs = [self._output(request, "", []) for request in ended if request is not None]
        return outputs[-1] if outputs else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def snapshot(self) -> EngineSnapshot:
        """Read it on the thread that steps the engine."""
        return EngineSnapshot(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_used=self.block_manager.num_used_blocks,
            num_kv_blocks_total=self.block_manager.num_blocks,
            num_steps=self.stats.num_steps,
            running_request_ids=tuple(dict.fromkeys(self.groups.request_id(r) for r in self.scheduler.running)),
            num_engines_busy=self.cores.last_busy,
        )

    def _fail(self, request_id: str, exc: Exception) -> RequestOutput | None:
        output = self.abort(request_id, FinishReason.ERROR)
        if output is None:
            return None
        output.error = errors.message(ErrorKind.ENGINE_FAULT,
                                      f"the engine failed while running this request: {type(exc).__name__}: {exc}")
        return output

    # ---- the step -------------------------------------------------------------------------------------------

    def step(self, only: Collection[str] | None = None) -> list[RequestOutput]:
        """One step; with ``only``, over just those requests (iterative batching: the others are not stepped)."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule(None if only is None else self.groups.expand(only))
        t1 = time.perf_counter()
        if not sched.scheduled:
            return []
        forks: list[Fork] = []
        try:
            if self.fault_hook is not None:
                self.fault_hook([s.request for s in sched.scheduled])
            inputs = self.runner.prepare(sched.scheduled, sched.blocks_to_copy)
            t2 = time.perf_counter()
            with self.cores.forward() as num_threads:  # its share of the cores, beside the other busy engines
                self.runner.use_threads(num_threads)
                # (S + P, V): a row per request that reached the end of its tokens, then the prompt_logprobs rows
                logits = self.runner.run(inputs)
            t3 = time.perf_counter()
            sampled = inputs.sampled_requests
            logits = self._keep_prompt_logprobs(inputs.prompt_rows, logits, len(sampled))  # (S, V)
            forks = self.groups.to_fork(sampled)  # parallel sampling: groups whose parent samples its first token
            if forks:  # each child's first token from its parent's row, with its own generator and grammar
                logits = torch.cat([logits, logits[[f.row for f in forks for _ in f.children]]])  # (S + children, V)
                sampled = sampled + [child for f in forks for child in f.children]
                for f in forks:
                    self.structured.fork(f.group.sequences[0].request_id, [c.request_id for c in f.children])
            request_ids = [r.request_id for r in sampled]
            self.structured.mask(logits, request_ids)  # rows with a grammar: only what can continue it
            picks = self.sampler.sample(
                logits, request_ids, [r.sampling_params for r in sampled],
                [() if rid in self.structured else r.banned_token_ids for rid, r in zip(request_ids, sampled)],
                [r.token_ids for r in sampled], [r.num_prompt_tokens for r in sampled],
            )
            t4 = time.perf_counter()
        except Exception as exc:  # the model or sampler failed: fail this step's requests only, keep serving
            log.exception("engine step failed; failing its %d requests", len(sched.scheduled))
            for child in (c for f in forks for c in f.children):  # never started: their grammars go with them
                self.structured.forget(child.request_id)
            failed = dict.fromkeys(self.groups.request_id(s.request) for s in sched.scheduled)
            return list(filter(None, (self._fail(request_id, exc) for request_id in failed)))
        new_tokens = {r.request_id: t for r, t in zip(sampled, picks.token_ids)}
        logprobs = {r.request_id: lp for r, lp in zip(sampled, picks.logprobs) if lp is not None}
        forked = self._fork(forks, new_tokens)  # before update: they hold the blocks should the parent finish
        updated = self.scheduler.update(sched, new_tokens)
        for sequence_id in self.groups.siblings_to_preempt(sched.preempted_ids):  # a group is preempted whole
            self.scheduler.preempt(sequence_id)
        outputs = [self._on_new_token(r, logprobs.get(r.request_id)) for r in updated + forked]
        t5 = time.perf_counter()
        self.stats.record_step(
            sched, StepTimes(schedule=t1 - t0, prepare=t2 - t1, forward=t3 - t2, sample=t4 - t3, update=t5 - t4),
            self.block_manager,
        )
        return outputs

    def _keep_prompt_logprobs(self, prompt_rows: tuple[PromptRows, ...], logits: torch.Tensor,
                              num_sampled: int) -> torch.Tensor:
        """Take the prompt positions' log-probabilities out of a step's logits (rows ``num_sampled`` on) and keep them
        until the request's first output; returns the sampled rows. A prompt recomputed from its start (preempted
        before its first token) replaces what it had."""
        first = num_sampled
        for rows in prompt_rows:
            r, start, n = rows.request, rows.start, rows.num_positions
            found = prompt_token_logprobs(logits[first : first + n], r.token_ids[start + 1 : start + n + 1],
                                          r.sampling_params.prompt_logprobs)
            kept = self._prompt_logprobs.setdefault(r.request_id, [])
            kept[start:] = found
            first += n
        return logits[:num_sampled]

    def _fork(self, forks: list[Fork], new_tokens: dict[str, int]) -> list[Request]:
        """Start the children of the groups whose parent sampled its first token in this step."""
        forked = []
        for fork in forks:
            for child in fork.children:
                child.append_token(new_tokens[child.request_id])
                self._add_detokenizer(child)
            self.groups.fork(fork.group, fork.children)
            self.scheduler.add_forked(fork.group.sequences[0], fork.children)
            forked += fork.children
        return forked

    def _on_new_token(self, request: Request, logprobs: TokenLogprobs | None = None) -> RequestOutput:
        token_id = request.token_ids[-1]
        detok = self._detokenizers[request.request_id]
        delta, hit_stop = detok.add_token(token_id)
        hit_stop |= self.structured.accept(request.request_id, token_id)  # the grammar is complete
        if hit_stop and not request.is_finished:
            self.scheduler.finish(request.request_id, FinishReason.STOP)
        prompt_logprobs = self._prompt_logprobs_of(request)  # before _output, which forgets a finished request's
        output = self._output(request, delta, [token_id])
        output.prompt_logprobs = prompt_logprobs
        if logprobs is not None:
            output.logprobs = [self._logprobs_of(token_id, logprobs)]
        return output

    def _prompt_logprobs_of(self, request: Request) -> list[dict[int, Logprob] | None] | None:
        """The prompt's log-probabilities, for the request's first output (with n > 1, its parent's: sequence 0's
        first output is the request's first), else None."""
        if request.num_output_tokens != 1 or request.sampling_params.prompt_logprobs is None or \
                self.groups.index(request) != 0:
            return None
        prompt = request.prompt_token_ids
        found = self._prompt_logprobs.pop(request.request_id, [])
        return [None] + [self._logprobs_of(prompt[p + 1], lp) for p, lp in enumerate(found)]

    def _logprobs_of(self, token_id: int, found: TokenLogprobs) -> dict[int, Logprob]:
        """vLLM's shape: the sampled token first, then the likeliest by rank, each with its text."""
        decode = self.tokenizer.hf.decode
        ranked = {token_id: Logprob(found.logprob, found.rank, decode([token_id]))}
        for rank, (tid, logprob) in enumerate(zip(found.top_token_ids, found.top_logprobs), start=1):
            if tid not in ranked:
                ranked[tid] = Logprob(logprob, rank, decode([tid]))
        return ranked

    def _output(self, request: Request, delta: str, new_token_ids: list[int]) -> RequestOutput:
        """The output of one sequence; the request's final one once all its sequences have finished."""
        ended = request.is_finished
        if ended:
            detok = self._detokenizers.pop(request.request_id, None)
            delta += detok.flush() if detok is not None else ""
            self.sampler.forget(request.request_id)
            self.structured.forget(request.request_id)
            self._prompt_logprobs.pop(request.request_id, None)
            self.stats.record_finish(request)
        request_id, index = self.groups.request_id(request), self.groups.index(request)
        finished = ended and self.groups.end(request)  # the last of the request's sequences to end
        return RequestOutput(
            request_id=request_id,
            delta_text=delta,
            new_token_ids=new_token_ids,
            finished=finished,
            finish_reason=request.finish_reason.value if ended and request.finish_reason else None,
            index=index,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            timings=request.timings,
            num_preemptions=request.num_preemptions,
            num_cached_tokens=min(request.num_cached_tokens, request.num_prompt_tokens),
        )

    # ---- offline API ----------------------------------------------------------------------------------------

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[CompletionOutput]:
        """Run prompts to completion (all submitted at once) and return them in order: a prompt with ``n`` > 1 gives
        its n completions, by index."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        requests = [self.add_request(None, p, sp) for p, sp in zip(prompts, params_list)]
        order = [(r.request_id, i) for r in requests for i in range(r.sampling_params.n)]
        results: dict[tuple[str, int], CompletionOutput] = {}
        pending: dict[tuple[str, int], list] = {key: [[], []] for key in order}  # delta texts, token ids
        while self.has_unfinished():
            for out in self.step():
                key = (out.request_id, out.index)
                deltas, tokens = pending[key]
                deltas.append(out.delta_text)
                tokens += out.new_token_ids
                if out.finish_reason is not None:
                    results[key] = CompletionOutput(
                        out.request_id, "".join(deltas), tokens, out.finish_reason, out.num_prompt_tokens,
                        out.timings, out.num_preemptions, deltas, out.index,
                    )
        return [results[key] for key in order]
