"""Engine configuration: a validating dataclass with vLLM's parameter names, and the model's shape.

It raises ``ValueError`` with a message a user can act on; ``assert`` would vanish under ``python -O``. The engine
resolves the user's :class:`EngineConfig` once, against the model's :class:`ModelShape`, into a frozen
:class:`ResolvedConfig` that every part of the engine reads. A request's own settings are ``SamplingParams``
(backend/engine/sampling_params.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType, UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from pydantic import TypeAdapter, ValidationError

from backend.engine import architectures
from backend.engine.shared_cores import CORE_SHARING, CoreSharing
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

# The settings' scalar types, converted from text ("8", "true", "0.9") by pydantic's lax rules (the ones a
# request's sampling settings follow); the name says what a setting of that type must be.
_SCALARS = {bool: (TypeAdapter(bool), "true or false"), int: (TypeAdapter(int), "an integer"),
            float: (TypeAdapter(float), "a number")}


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
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown engine parameter(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        types = get_type_hints(cls)
        kwargs = {name: _setting(name, types[name], raw) for name, raw in values.items()}
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


def _setting(name: str, hint: Any, raw: Any) -> Any:
    """One setting as given (text, or already its type) -> the field's type: a bool, int or float by pydantic's
    conversion, None for an empty optional one; any other type (a name: dtype, device, batching, quantization...) as
    text, which ``__post_init__`` checks and explains."""
    members = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
    kind = next((m for m in members if m is not type(None)), hint)
    given = raw.strip() if isinstance(raw, str) else raw
    if raw is None or (given == "" and type(None) in members):
        return None
    if kind not in _SCALARS:
        return str(raw)
    adapter, what = _SCALARS[kind]
    try:
        return adapter.validate_python(given)
    except ValidationError:
        raise ValueError(f"{name} must be {what}; got {raw!r}") from None


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
