"""Structured output: a request's answer held to a JSON schema, any JSON object, a regex, a choice of strings or a
Lark grammar, by masking the logits of every token that could not continue it (vLLM's ``structured_outputs``).

The grammar engine is llguidance (the Rust library behind vLLM's ``guidance`` backend): a token mask costs tens of
microseconds per row, with no grammar compilation up front, so a new schema does not stall the step, and it needs
nothing beyond its one wheel (no compiler, no torch.compile, the same wheel for every Python from 3.9). xgrammar is
faster per mask once a grammar is compiled, but compiles each new schema first (milliseconds to seconds, on the
thread that steps the engine) and pulls in a second runtime; the step here is 10-100 ms on a CPU, so a 35 us mask
per row is already small beside it.

Where it runs in a step: after the forward, before the sampler, each sampled row whose request has a grammar gets
its mask (one bit per token; several rows' on the engine's threads at once) and every token outside it becomes
``-inf``; after the token is chosen, the request's
matcher consumes it. A request ends (finish reason ``stop``) once its grammar can take nothing more: the JSON object
is closed, the choice is complete. EOS ends it earlier only where the grammar allows an end there. ``min_tokens`` and
the EOS ban do not apply to a request with a grammar (the grammar says when the answer may end). A preempted request
keeps its matcher: its tokens are recomputed, not sampled again.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from backend.contract.errors import InvalidRequest, refuse_unknown

if TYPE_CHECKING:
    import torch

STRUCTURED_OUTPUTS = "structured_outputs"
# A schema, regex or grammar is one request's input: bounded like the other texts a request may send.
MAX_SPEC_CHARS = 32 * 1024
MAX_CHOICES = 256
# NOTE: JSON may have whitespace between its tokens, and unbounded it lets a model emit blanks until max_tokens (a
# known failure of grammar-constrained JSON; vLLM's answer is an option to forbid it). Bounded, pretty-printed JSON
# still fits (a newline and the indentation of deep nesting) and a runaway is cut short. A schema's own
# ``x-guidance`` options override this.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,24}"}
# The tokenizer's slices (llguidance): groups of tokens a mask takes whole, without walking the token trie, where the
# grammar allows every string of the slice's regex at that point. llguidance's own are JSON's (whitespace, string
# contents); these add the runs of letters and spaces that free-text regexes allow (``[a-z ,.]+``, ``[A-Za-z ]*``):
# such a regex's mask then costs a tenth as much.
TEXT_SLICES = ("[a-z]{1,16}", "[a-z ]{1,16}", "[A-Za-z ]{1,16}")
# From this many rows with a grammar, their masks are computed on llguidance's thread pool (see mask()).
PARALLEL_MASK_ROWS = 16


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's ``structured_outputs`` (exactly one of): ``json`` (a JSON schema, as a dict or its text),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings), ``grammar`` (Lark syntax)."""

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequest(STRUCTURED_OUTPUTS, "structured_outputs takes exactly one of json, json_object, "
                                                     f"regex, choice, grammar; got {given or 'none'}")
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            if not isinstance(self.json, (str, dict)) or len(text) > MAX_SPEC_CHARS:
                raise InvalidRequest(STRUCTURED_OUTPUTS, "structured_outputs.json must be a JSON schema (an object) "
                                                         f"of at most {MAX_SPEC_CHARS} characters")
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(STRUCTURED_OUTPUTS, f"structured_outputs.json is not valid JSON: {exc.msg}") \
                    from None
            if not isinstance(schema, dict):
                raise InvalidRequest(STRUCTURED_OUTPUTS, "structured_outputs.json must be a JSON schema (an object)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_SPEC_CHARS):
                raise InvalidRequest(STRUCTURED_OUTPUTS, f"structured_outputs.{name} must be a non-empty string of "
                                                         f"at most {MAX_SPEC_CHARS} characters")
        if self.choice is not None:
            choice = self.choice
            if (not isinstance(choice, (list, tuple)) or not 0 < len(choice) <= MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in choice)):
                raise InvalidRequest(STRUCTURED_OUTPUTS, "structured_outputs.choice must be a list of 1 to "
                                                         f"{MAX_CHOICES} non-empty strings")
            object.__setattr__(self, "choice", tuple(choice))
        if not isinstance(self.json_object, bool):
            raise InvalidRequest(STRUCTURED_OUTPUTS, "structured_outputs.json_object must be true or false")

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputsParams | None:
        """From what a request sent: an instance, a dict with vLLM's keys, or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequest(STRUCTURED_OUTPUTS, "structured_outputs must be an object with one of json, "
                                                     "json_object, regex, choice, grammar")
        refuse_unknown(value, (f.name for f in fields(cls)), STRUCTURED_OUTPUTS,
                       "unknown key(s) in structured_outputs")
        return cls(**value)

    def grammar_text(self) -> str:
        """The request's grammar in llguidance's form."""
        from llguidance import LLMatcher

        if self.json is not None:
            return LLMatcher.grammar_from_json_schema(self.json, defaults=JSON_OPTIONS)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)


class StructuredOutputs:
    """The engine's grammars: one matcher per request that asked for structured output. Used by the thread that
    steps the engine (``add`` may run on the thread that adds requests; the tokenizer is built once, under a lock)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], num_threads: int = 1) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._num_threads = max(1, num_threads)
        self._executor = None  # llguidance's thread pool, for the masks of several rows at once
        self._tokenizer = None
        self._lock = threading.Lock()
        self._matchers: dict[str, Any] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def _llg_tokenizer(self):
        with self._lock:  # NOTE: about a second, once per engine: built at the first request that needs it
            if self._tokenizer is None:
                import llguidance.hf
                from llguidance import LLTokenizer

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_token_ids,
                    slices=[*LLTokenizer.general_slices(), *TEXT_SLICES])
            return self._tokenizer

    def add(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Compile ``params`` for ``request_id``; an invalid schema, regex or grammar is this request's 400."""
        from llguidance import LLMatcher

        tokenizer = self._llg_tokenizer()
        grammar = params.grammar_text()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise InvalidRequest(STRUCTURED_OUTPUTS, f"structured_outputs cannot be compiled: {messages[0]}")
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(STRUCTURED_OUTPUTS, f"structured_outputs cannot be compiled: {matcher.get_error()}")
        self._matchers[request_id] = matcher

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def fork(self, parent_id: str, child_ids: list[str]) -> None:
        """Parallel sampling: each child continues from its parent's grammar state, as a copy of its own."""
        matcher = self._matchers.get(parent_id)
        if matcher is not None:
            for child_id in child_ids:
                self._matchers[child_id] = matcher.deep_copy()

    def mask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Set to ``-inf``, in place, every logit a row's grammar does not allow next (rows without one untouched)."""
        rows = [(row, self._matchers[rid]) for row, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return
        import numpy as np
        import torch

        from backend.kernels import cpu_kernels

        vocab = logits.shape[-1]
        words = (vocab + 31) // 32
        bitmask = np.empty((len(rows), words), dtype=np.int32)
        # NOTE: between forwards the engine's cores are free for them; but a mask costs tens of microseconds, and
        # handing 8 of them to llguidance's pool cost more than computing them here (0.32 against 0.19 ms)
        if len(rows) >= PARALLEL_MASK_ROWS and self._num_threads > 1:
            if self._executor is None:
                from llguidance import LLExecutor

                self._executor = LLExecutor(num_threads=self._num_threads)
            self._executor.unsafe_compute_mask_ptr([(matcher, i) for i, (_, matcher) in enumerate(rows)],
                                                   bitmask.ctypes.data, words * 4, len(rows))
        else:
            for i, (_, matcher) in enumerate(rows):
                matcher.unsafe_compute_mask_ptr(bitmask[i].ctypes.data, words * 4)
        if cpu_kernels.supports_sampling(logits):  # the C twin: a whole word of forbidden tokens at a time
            cpu_kernels.cpu_apply_token_bitmask(logits, [row for row, _ in rows], bitmask)
            return
        # NOTE: written through numpy on this thread alone: a torch masked_fill over [rows, vocab] is an OpenMP
        # region, and with the cores busy (other engines, a loaded machine) its threads' wake-up cost ms per step.
        # The -inf goes in as its bit pattern, so the model's dtype (bf16 too, which numpy lacks) needs no copy.
        # -inf of each float dtype as the integer of the same width with the same bits (0xFF80, 0xFC00, 0xFF800000)
        int_dtype, np_dtype, neg_inf = {torch.bfloat16: (torch.int16, np.int16, -0x80),
                                        torch.float16: (torch.int16, np.int16, -0x400),
                                        torch.float32: (torch.int32, np.int32, -0x800000)}[logits.dtype]
        # Each bit widened to a whole word: allowed 1 -> 0, forbidden 0 -> all ones; then the write is bitwise,
        # value & ~forbidden | -inf & forbidden, with no boolean indexing (a putmask cost about 3x as much per row).
        forbidden = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(np_dtype)
        forbidden -= 1
        values = logits.view(int_dtype).numpy()
        for i, (row, _) in enumerate(rows):
            kept = values[row] & ~forbidden[i]
            np.bitwise_or(kept, forbidden[i] & np_dtype(neg_inf), out=values[row])

    def accept(self, request_id: str, token_id: int) -> bool:
        """The row's chosen token, consumed by its grammar; true when the grammar can take nothing more (the
        answer is complete), or when it is in error (it cannot continue: the request ends rather than run on
        unconstrained)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        matcher.consume_token(token_id)
        return matcher.is_stopped() or matcher.is_error()
