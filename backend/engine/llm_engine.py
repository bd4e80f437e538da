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

from backend.contract import errors
from backend.contract.errors import PROMPT, ErrorKind, InvalidRequest
from backend.engine.block_manager import BlockManager
from backend.engine.config import EngineConfig, SamplingParams
from backend.engine.detokenizer import IncrementalDetokenizer
from backend.engine.model_runner import ModelRunner
from backend.engine.openmp import check_wait_policy
from backend.engine.request import FinishReason, Request, RequestTimings
from backend.engine.sampler import Sampler
from backend.engine.scheduler import Scheduler
from backend.engine.shared_cores import SharedCores
from backend.engine.stats import EngineStats, StepTimes
from backend.engine.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request: the text and token ids new since its last output; the last output is
    ``finished``."""

    request_id: str
    delta_text: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # a FinishReason value, on the final output
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    timings: RequestTimings | None = None
    num_preemptions: int = 0
    error: str | None = None  # on a final output that failed: the message its client gets (backend/contract/errors.py)


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
        self.stats = EngineStats()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
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
        params = params or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise InvalidRequest(PROMPT, "the prompt is empty: it encodes to zero tokens")
        request = Request(request_id, token_ids, params, self.eos_token_ids, arrival_time, priority)
        self.scheduler.add_request(request)  # refuses what can never fit: max_model_len, the KV pool
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer.hf, token_ids, params.stop, params.min_tokens
        )
        return request

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; returns its final output, or None if it is unknown."""
        request = self.scheduler.finish(request_id, reason)
        if request is None:
            return None
        return self._output(request, "", [])

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
            running_request_ids=tuple(r.request_id for r in self.scheduler.running),
            num_engines_busy=self.cores.last_busy,
        )

    def _fail(self, request: Request, exc: Exception) -> RequestOutput:
        self.scheduler.finish(request.request_id, FinishReason.ERROR)
        output = self._output(request, "", [])
        output.error = errors.message(ErrorKind.ENGINE_FAULT,
                                      f"the engine failed while running this request: {type(exc).__name__}: {exc}")
        return output

    # ---- the step -------------------------------------------------------------------------------------------

    def step(self, only: Collection[str] | None = None) -> list[RequestOutput]:
        """One step; with ``only``, over just those requests (iterative batching: the others are not stepped)."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule(only)
        t1 = time.perf_counter()
        if not sched.scheduled:
            return []
        try:
            if self.fault_hook is not None:
                self.fault_hook([s.request for s in sched.scheduled])
            inputs = self.runner.prepare(sched.scheduled)
            t2 = time.perf_counter()
            with self.cores.forward() as num_threads:  # its share of the cores, beside the other busy engines
                self.runner.use_threads(num_threads)
                logits = self.runner.run(inputs)  # (S, V): one row per request that reached the end of its tokens
            t3 = time.perf_counter()
            sampled = inputs.sampled_requests
            token_ids = self.sampler(
                logits, [r.request_id for r in sampled], [r.sampling_params for r in sampled],
                [r.banned_token_ids for r in sampled],
            )
            t4 = time.perf_counter()
        except Exception as exc:  # the model or sampler failed: fail this step's requests only, keep serving
            log.exception("engine step failed; failing its %d requests", len(sched.scheduled))
            return [self._fail(s.request, exc) for s in sched.scheduled if not s.request.is_finished]
        updated = self.scheduler.update(sched, {r.request_id: t for r, t in zip(sampled, token_ids)})
        outputs = [self._on_new_token(r) for r in updated]
        t5 = time.perf_counter()
        self.stats.record_step(
            sched, StepTimes(schedule=t1 - t0, prepare=t2 - t1, forward=t3 - t2, sample=t4 - t3, update=t5 - t4),
            self.block_manager,
        )
        return outputs

    def _on_new_token(self, request: Request) -> RequestOutput:
        token_id = request.token_ids[-1]
        detok = self._detokenizers[request.request_id]
        delta, hit_stop = detok.add_token(token_id)
        if hit_stop and not request.is_finished:
            self.scheduler.finish(request.request_id, FinishReason.STOP)
        return self._output(request, delta, [token_id])

    def _output(self, request: Request, delta: str, new_token_ids: list[int]) -> RequestOutput:
        finished = request.is_finished
        if finished:
            detok = self._detokenizers.pop(request.request_id, None)
            delta += detok.flush() if detok is not None else ""
            self.sampler.forget(request.request_id)
            self.stats.record_finish(request)
        return RequestOutput(
            request_id=request.request_id,
            delta_text=delta,
            new_token_ids=new_token_ids,
            finished=finished,
            finish_reason=request.finish_reason.value if finished and request.finish_reason else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            timings=request.timings,
            num_preemptions=request.num_preemptions,
        )

    # ---- offline API ----------------------------------------------------------------------------------------

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[CompletionOutput]:
        """Run prompts to completion (all submitted at once) and return them in order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        order = [self.add_request(None, p, sp).request_id for p, sp in zip(prompts, params_list)]
        results: dict[str, CompletionOutput] = {}
        pending: dict[str, list] = {rid: [[], []] for rid in order}  # delta texts, token ids
        while self.has_unfinished():
            for out in self.step():
                deltas, tokens = pending[out.request_id]
                deltas.append(out.delta_text)
                tokens += out.new_token_ids
                if out.finished:
                    results[out.request_id] = CompletionOutput(
                        out.request_id, "".join(deltas), tokens, out.finish_reason or "", out.num_prompt_tokens,
                        out.timings, out.num_preemptions, deltas,
                    )
        return [results[rid] for rid in order]
