"""Engine and sampling configuration: validating dataclasses with vLLM's parameter names, and the model's shape.

They raise ``ValueError`` with a message a user can act on; ``assert`` would vanish under ``python -O``. A request's
settings that the engine cannot take raise the contract's ``InvalidRequest`` (a ``ValueError`` that names the
parameter, backend/contract/errors.py), which the client gets as its error. The engine resolves the user's
:class:`EngineConfig` once, against the model's :class:`ModelShape`, into a frozen :class:`ResolvedConfig` that every
part of the engine reads.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from backend.contract.errors import InvalidRequest
from backend.engine import architectures
from backend.engine.shared_cores import CORE_SHARING, CoreSharing
from backend.engine.structured_output import StructuredOutputsParams
from backend.kernels.weight_format import WeightFormat

log = logging.getLogger(__name__)

Batching = Literal["continuous", "run_to_completion", "iterative"]
BATCHING = ("continuous", "run_to_completion", "iterative")
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES = ("fcfs", "priority")
_DTYPES = ("bfloat16", "float16", "float32")  # torch's own names: the engine's dtype is getattr(torch, dtype)
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Weight-only formats (vLLM's ``quantization``): the GGUF's own 4-bit Q4_1 blocks, or int8 per output channel.
QUANTIZATIONS = (WeightFormat.Q4_1, WeightFormat.INT8)
# The weights a model can run on, as the tools' --quantization and --formats name them: the checkpoint's in bf16
# (quantization none), or a quantization.
WEIGHT_FORMATS = (WeightFormat.BF16, *QUANTIZATIONS)
# The GGUF's quantized tensors beside a converted checkpoint (tools/prepare_model.py writes them, q4_1 serves
# them): uint8 [N, row bytes] under the checkpoint's names, each one's format (quantized_linear's) in the metadata.
GGUF_BLOCKS = Path("quantized") / "gguf_blocks.safetensors"

# Default KV pool on a CPU when neither a block count nor a byte budget is given (vLLM's CPU backend uses 4 GiB).
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


@dataclass(frozen=True)
class ModelShape:
    """The model's dimensions, from its Hugging Face ``config.json`` (read once, by :meth:`from_model_dir`), which
    must ask for nothing the forward does not compute (backend/engine/architectures.py)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None = None  # positions a sliding layer attends to; None: every layer attends to all
    hf_config: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)  # the whole file, read-only

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelShape:
        architectures.check_supported(cfg)
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=architectures.sliding_window(cfg),
            hf_config=MappingProxyType(dict(cfg)),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelShape:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model folder {model_dir} has no config.json (prepare one with `make model`)")
        return cls.from_hf_config(json.loads(path.read_text()))


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know before it loads a model, as the user gives it.

    ``max_model_len=None`` means "the model's own ``max_position_embeddings``" (its ``sliding_window`` if smaller:
    ``ModelShape.sliding_window``); the engine resolves it once
    (:meth:`resolve`), and every part reads the :class:`ResolvedConfig`. The KV pool is sized
    from ``num_kv_blocks`` if given, else from ``kv_cache_memory_bytes``, else on CUDA from what
    ``gpu_memory_utilization`` of the device's memory leaves once the weights and the activation peak of a forward
    at ``max_num_batched_tokens`` are counted (as vLLM does), else on CPU ``DEFAULT_CPU_KV_CACHE_BYTES``.
    """

    model: str = ""
    dtype: str = "bfloat16"
    device: str = "cpu"  # "cpu", "cuda", "cuda:N", or "auto" (CUDA when torch sees a GPU, else the CPU)
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    # None (or "none"): the weights in ``dtype`` as today; "q4_1" or "int8" (held as the WeightFormat): weight-only
    # quantized projections (backend/kernels/quantized_linear.py), bf16 activations, on the CPU.
    quantization: WeightFormat | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    # Who may join the running batch: anyone, every step (continuous), nobody until the batch in flight has
    # finished (run_to_completion: what Triton's dynamic batcher gives a generation model), or whoever the caller
    # names for each step (iterative: Triton's iterative sequence batcher).
    batching: Batching = "continuous"
    # Who goes first (vLLM's name and values): arrival order ("fcfs"), or each request's priority, a lower value
    # first, then arrival ("priority"): backend/engine/scheduler.py says what it preempts and that it has no ageing.
    scheduling_policy: SchedulingPolicy = "fcfs"
    num_threads: int | None = None  # torch intra-op threads; None = all cores
    # How engines that step at once share the cores (backend/engine/shared_cores.py): "divide" the threads among
    # the busy ones, one forward at a time ("step_lock"), or every engine on every thread ("off").
    core_sharing: CoreSharing = "divide"
    max_queue_size: int = 1024  # waiting requests beyond this are refused ("overloaded")
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _DTYPE_ALIASES.get(str(self.dtype).lower(), str(self.dtype).lower()))
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}; got {self.dtype!r}")
        if not re.fullmatch(r"cpu|auto|cuda(:\d+)?", str(self.device)):
            raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto'; got {self.device!r}")
        _positive("block_size", self.block_size)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (e.g. 16 or 32); got {self.block_size}")
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.kv_cache_memory_bytes is not None:
            _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs one token of budget per decode step"
            )
        if self.max_model_len is not None:
            self._check_max_model_len()
        self._check_quantization()
        if self.batching not in BATCHING:
            raise ValueError(f"batching must be one of {', '.join(BATCHING)}; got {self.batching!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; "
                             f"got {self.scheduling_policy!r}")
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        if self.core_sharing not in CORE_SHARING:
            raise ValueError(f"core_sharing must be one of {', '.join(CORE_SHARING)}; got {self.core_sharing!r}")
        _positive("max_queue_size", self.max_queue_size)

    def _check_quantization(self) -> None:
        quantization = parse_quantization(self.quantization)
        object.__setattr__(self, "quantization", quantization)
        if quantization is None:
            return
        if self.dtype != "bfloat16":
            raise ValueError(
                f"quantization={quantization} computes in bfloat16 (its kernels take bf16 activations); "
                f"set dtype=bfloat16 (got {self.dtype})"
            )
        if self.device != "cpu":
            raise ValueError(
                f"quantization={quantization} has CPU kernels only; set device=cpu (got {self.device!r}) "
                "or quantization=none"
            )

    def _check_max_model_len(self) -> None:
        """The limits that depend on max_model_len: the one place each is checked."""
        _positive("max_model_len", self.max_model_len)
        if self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be >= 2 (a prompt token and a generated one); got {self.max_model_len}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) with chunked prefill off, so a long prompt could never be scheduled; "
                "raise max_num_batched_tokens, lower max_model_len, or set enable_chunked_prefill=true"
            )

    def resolve(self, shape: ModelShape | None = None) -> ResolvedConfig:
        """This config against the model (``shape``, else read from ``model``): ``max_model_len`` filled in and
        checked against what the model supports. The engine calls this once; this config is left as it is."""
        shape = shape or ModelShape.from_model_dir(self.model)
        model_max_len, window = shape.max_position_embeddings, shape.sliding_window
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = model_max_len if self.enable_chunked_prefill else min(model_max_len,
                                                                                  self.max_num_batched_tokens)
            if window is not None and window < max_model_len:
                log.warning("max_model_len is %d, the model's sliding_window, not %d: the engine attends to every "
                            "earlier token, which is the model's sliding-window attention only inside the window, so "
                            "no sequence grows past it", window, max_model_len)
                max_model_len = window
        elif max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings ({model_max_len})"
            )
        elif window is not None and max_model_len > window:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's sliding_window ({window}): the engine attends "
                "to every earlier token, so past the window its output would not be the model's; set "
                f"max_model_len <= {window}, or leave it unset (it is then {window})"
            )
        settings = {f.name: getattr(self, f.name) for f in fields(EngineConfig)}
        return ResolvedConfig(**{**settings, "max_model_len": max_model_len}, model_shape=shape)

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    def kv_block_bytes(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one KV block across all layers (K and V)."""
        return 2 * num_layers * self.block_size * num_kv_heads * head_dim * self.dtype_bytes

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        """Build from string-valued settings (Triton ``parameters``, environment, CLI). Unknown keys are refused."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown engine parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        kwargs: dict[str, Any] = {}
        for name, raw in values.items():
            kind = str(known[name].type)
            if raw is None or (isinstance(raw, str) and raw.strip() == "" and "None" in kind):
                kwargs[name] = None
            elif kind.startswith("bool"):
                kwargs[name] = _parse_bool(raw)
            elif kind.startswith("int"):
                kwargs[name] = _parse_int(name, raw)
            elif kind.startswith("float"):
                kwargs[name] = float(raw)
            else:
                kwargs[name] = str(raw)
        if kwargs.get("model"):
            kwargs["model"] = os.path.expanduser(kwargs["model"])
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True)
class ResolvedConfig(EngineConfig):
    """An :class:`EngineConfig` once the model is known: ``max_model_len`` is set, and the model's shape is here.
    Built once by the engine (:meth:`EngineConfig.resolve`) and passed to every part that reads either."""

    model_shape: ModelShape

    def __post_init__(self) -> None:
        if self.max_model_len is None:
            raise ValueError("a resolved config needs max_model_len (build it with EngineConfig.resolve)")
        super().__post_init__()

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across all layers (K and V)."""
        s = self.model_shape
        return self.kv_block_bytes(s.num_layers, s.num_kv_heads, s.head_dim)


def parse_quantization(value: Any) -> WeightFormat | None:
    """``quantization`` as a user gives it (config.pbtxt, a dict of settings, a keyword): one of
    :data:`QUANTIZATIONS` by name, in any case, or None, empty or "none" for the weights in ``dtype``."""
    if value is None or str(value).strip().lower() in ("", "none"):
        return None
    return WeightFormat.parse(value, QUANTIZATIONS, "quantization", also="or none")


def _parse_int(name: str, raw: Any) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw  # NOTE: not through float: a 64-bit seed would lose its low bits
    if isinstance(raw, str) and re.fullmatch(r"\s*[-+]?\d+\s*", raw):
        return int(raw)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer; got {raw!r}") from None
    if not value.is_integer():
        raise ValueError(f"{name} must be an integer; got {raw!r}")
    return int(value)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


# Limits that protect the server from a single request (docs/server.md, "What a request may ask for").
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit, and vLLM's default max_logprobs
MAX_N = 16  # answers of one prompt (parallel sampling), each one sequence of the batch


@dataclass
class SamplingParams:
    """Per-request generation settings, named as in vLLM.

    ``temperature == 0`` means greedy. ``top_k == 0``, ``top_p == 1`` and ``min_p == 0`` disable those filters.
    ``max_tokens=None`` means "until the model's length limit". ``min_tokens``: EOS, ``stop_token_ids`` and stop
    strings cannot end the request before this many tokens were generated (as in vLLM: those tokens are not sampled).
    ``presence_penalty`` and ``frequency_penalty`` (OpenAI's, over the generated tokens), ``repetition_penalty``
    (vLLM's, over prompt and generated tokens; 1 = off) and ``logit_bias`` (token id -> added to its logit) apply to
    greedy requests too (backend/engine/logits_processors.py).
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # the sampled token's log-probability and this many likeliest tokens' (None: none)
    include_stop_str_in_output: bool = False  # a stop string that ends the text stays in it
    skip_special_tokens: bool = True  # special tokens (EOS, chat markers) are left out of the text
    structured_outputs: StructuredOutputsParams | None = None  # backend/engine/structured_output.py

    # Parallel sampling: n answers of one prompt, computed once (backend/engine/parallel_sampling.py). vLLM's
    # best_of (sample more, return the n likeliest) is not offered: it would need each sequence's log probability.
    n: int = 1

    def __post_init__(self) -> None:
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise InvalidRequest("n", f"n must be an integer from 1 to {MAX_N}; got {self.n!r}")
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
                raise InvalidRequest("max_tokens", f"max_tokens must be a positive integer; got {self.max_tokens!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequest("min_tokens", f"min_tokens must be an integer >= 0; got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens",
                                 f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        temperature = self.temperature
        if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
            raise InvalidRequest("temperature",
                                 f"temperature must be a finite number >= 0 (0 = greedy); got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p", f"top_p must be in (0, 1]; got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest("top_k", f"top_k must be an integer >= 0 (0 = disabled); got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequest("seed", f"seed must be an integer; got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise InvalidRequest("seed", f"seed must fit in 64 bits (from -2**63 to 2**64 - 1); got {self.seed}")
        if self.seed is not None and self.seed + self.n - 1 >= 2**64:  # sequence i samples with seed + i
            raise InvalidRequest("seed", f"seed + n - 1 must fit in 64 bits (up to 2**64 - 1); got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed; got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest("stop", f"stop strings must be non-empty strings; got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequest("stop",
                                     f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters; got {len(s)}")
        self._check_logits_settings()
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequest("logprobs", f"logprobs must be an integer from 0 to {MAX_LOGPROBS} (the likeliest "
                                             f"tokens to return beside the sampled one); got {self.logprobs!r}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)

    def _check_logits_settings(self) -> None:
        """The settings that adjust the logits (their ranges as OpenAI's and vLLM's)."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequest(name, f"{name} must be a number in [-2, 2]; got {value!r}")
            setattr(self, name, float(value))
        if not _number(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise InvalidRequest("repetition_penalty",
                                 f"repetition_penalty must be a number > 0 (1 = off); got {self.repetition_penalty!r}")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest("min_p", f"min_p must be in [0, 1] (0 = off); got {self.min_p!r}")
        self.repetition_penalty, self.min_p = float(self.repetition_penalty), float(self.min_p)
        if not isinstance(self.logit_bias, dict):
            raise InvalidRequest("logit_bias", f"logit_bias must map token ids to biases; got {self.logit_bias!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidRequest("logit_bias", f"logit_bias may name at most {MAX_LOGIT_BIAS_TOKENS} tokens; "
                                               f"got {len(self.logit_bias)}")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidRequest("logit_bias", f"logit_bias keys must be token ids (integers >= 0); got {token!r}")
            if not _number(bias) or not -100.0 <= bias <= 100.0:
                raise InvalidRequest("logit_bias", f"logit_bias values must be in [-100, 100]; got {bias!r} "
                                                   f"for token {token}")
        self.logit_bias = {token: float(bias) for token, bias in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def check_token_ids(self, vocab_size: int) -> None:
        """Refuse token ids this model does not have (the sampler indexes its logits with them)."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            beyond = [t for t in ids if not 0 <= t < vocab_size]
            if beyond:
                raise InvalidRequest(name, f"{name} names token id {beyond[0]}; this model's token ids are "
                                           f"0 to {vocab_size - 1}")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler adjusts this request's logits before the draw (logits_processors.py)."""
        return self.has_penalties or bool(self.logit_bias) or (self.min_p > 0.0 and not self.greedy)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        if "best_of" in raw:
            raise InvalidRequest("best_of", "best_of is not supported: each of the n answers is returned; send n "
                                            "alone")
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidRequest(None, f"unknown sampling parameter(s): {', '.join(unknown)}; "
                                       f"known: {', '.join(sorted(known))}")
        kw: dict[str, Any] = {}
        for key, value in raw.items():
            try:
                kw[key] = _sampling_value(key, value)
            except ValueError as exc:
                raise InvalidRequest(key, str(exc)) from None
        return cls(**kw)


def _sampling_value(key: str, value: Any) -> Any:
    """One sampling setting as sent (numbers may be strings, as genai-perf sends them) -> its type."""
    if key in ("max_tokens", "min_tokens", "top_k", "seed", "logprobs", "n") and value is not None:
        return _parse_int(key, value)
    if key in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be a number; got {value!r}") from None
    if key in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        return _parse_bool(value)
    if key == "stop":
        return [value] if isinstance(value, str) else list(value or [])
    if key == "stop_token_ids":
        return [_parse_int(key, v) for v in (value or [])]
    if key == "logit_bias" and isinstance(value, dict):  # JSON keys are strings
        return {_parse_int(key, token): bias for token, bias in value.items()}
    if key == "logit_bias" and value is None:
        return {}
    return value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
