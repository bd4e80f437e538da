"""C twins of torch hot spots, for CPUs: built at first use, loaded with ctypes.

``cpu_decode_attention`` takes the same inputs as ``backend.engine.attention.paged_decode_attention`` and returns the same
result (float32 arithmetic; bf16 rounded once at the end). It reads K/V through the block tables in place, where the
torch path first copies every sequence's K/V out of the pool once per layer; at batch 64 that copy and SDPA's
small-query overhead cost a tenth of a decode step.

``cpu_rope_paged_attention`` is ``rope_paged_attention``'s twin: one call per layer from the QKV projection's output
rotates q and k, writes K/V to the pool and attends the decodes, where the torch ops took a dozen calls (the rotary
embedding alone cost as much as the attention at batch 64).

``cpu_rms_norm`` is HF's LlamaRMSNorm in one pass per row; ``F.rms_norm`` on bf16 runs eight tensor ops (widening
the whole input to float32), which cost more than the layer's attention at batch 1 and 2.5x a layer_norm in prefill.

The shared library is compiled from ``cpu_kernels.c`` with the system C compiler (``$CC``, default ``cc``) into
``$XDG_CACHE_HOME/llm-batching-triton`` (keyed by source, flags and CPU), once per machine (about a second), for
``-march=native`` (``LLM_CPU_MARCH`` names another target, e.g. ``x86-64-v2``: the tests build one without AVX-512).
Without a compiler, on a non-glibc system, or with ``LLM_CPU_KERNELS=0``, :func:`load` returns ``None`` and the
model keeps the torch code.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from backend.engine.attention import (
    AttentionMetadata,
    attend_prefills,
    paged_attention,
    paged_decode_attention,
    rope_paged_attention,
)

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -ffast-math lets the compiler vectorise the float dot products (reassociation); inputs are finite by construction.
_FLAGS = ("-O3", f"-march={os.environ.get('LLM_CPU_MARCH', 'native')}", "-mprefer-vector-width=512", "-Wno-psabi", "-ffast-math", "-fopenmp", "-shared", "-fPIC")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_loaded = False


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or ``None`` when it cannot be built here (the torch path is used instead)."""
    global _lib, _loaded
    with _lock:
        if not _loaded:
            _loaded = True
            if os.environ.get("LLM_CPU_KERNELS", "1") == "0":
                return None
            try:
                _lib = _build_and_load()
            except (OSError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", b"") or b""
                log.warning("CPU decode kernel unavailable, using the torch path: %s %s", exc, detail.decode()[-500:])
        return _lib


def _build_and_load() -> ctypes.CDLL:
    compiler = os.environ.get("CC", "cc")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), compiler.encode(), _cpu_id()])).hexdigest()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm-batching-triton"
    path = cache / f"cpu_kernels-{key[:16]}.so"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build aside, then rename: safe with parallel builders
            built = Path(tmp) / path.name
            subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"], check=True, capture_output=True,
                           timeout=300)
            os.replace(built, path)
    lib = ctypes.CDLL(str(path))  # torch is imported first, so libgomp.so.1 resolves to torch's own OpenMP runtime
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_decode_attention.argtypes = [
        ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr,  # query, caches, block tables, context lens
        i64, i64, i64, i64, i64, ctypes.c_float, i64,  # B, H, KVH, D, block_size, scale, max_context
        ptr, i64, i64, ctypes.c_int, ctypes.c_int,  # out, dtype, num_threads
    ]
    lib.paged_decode_attention.restype = None
    lib.rope_paged_attention.argtypes = [
        ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64,  # qkv, positions, tables, slots, caches
        i64, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_float, i64,  # decodes, block tables, H, KVH, D, scale
        ptr, i64, i64, ctypes.c_int, ctypes.c_int,  # out, dtype, num_threads
    ]
    lib.rope_paged_attention.restype = None
    lib.rms_norm.argtypes = [ptr, i64, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.rms_norm.restype = None
    lib.sample_rows.argtypes = [ptr, i64, ctypes.c_int, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.sample_rows.restype = None
    lib.linear_small.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_int, ptr, i64, ptr, ctypes.c_int]
    lib.linear_small.restype = ctypes.c_int
    lib.linear_weight_packed.restype = ctypes.c_int
    lib.decode_stack.argtypes = [
        ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr,  # h, weights per layer
        ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float,  # AMX copies per layer, small_rows, I, eps
        ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64,  # positions, cos, sin, slots, K and V pools per layer, strides
        ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_float, i64,  # block tables, context lens, H, KVH, D, ...
        ptr, ptr, ptr, ptr, ptr, ctypes.c_int,  # scratch: x, qkv, attn, gate, up; num_threads
    ]
    lib.decode_stack.restype = ctypes.c_int
    lib.pack_linear_weight.argtypes = [ptr, i64, i64, ptr]
    lib.pack_linear_weight.restype = None
    lib.linear_amx.argtypes = lib.linear_small.argtypes
    lib.linear_amx.restype = ctypes.c_int
    lib.linear_amx_available.restype = ctypes.c_int
    lib.pack_linear_weight_amx.argtypes = [ptr, i64, i64, ptr]
    lib.pack_linear_weight_amx.restype = None
    for limit in (lib.max_group, lib.max_head_dim, lib.max_row):
        limit.restype = ctypes.c_int
    lib.limits = (lib.max_group(), lib.max_head_dim(), lib.max_row())
    return lib


def _cpu_id() -> bytes:
    """-march=native code is only valid on the CPU it was built for: key the cache by model name and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b""
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted).encode()


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors (else the caller uses the torch path)."""
    lib = load()
    if lib is None or query.device.type != "cpu" or query.dtype not in _DTYPE_CODES:
        return False
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    max_group, max_head_dim, _ = lib.limits
    return (
        k_cache.dtype == v_cache.dtype == query.dtype
        and k_cache.stride() == v_cache.stride()
        and query.stride(-1) == k_cache.stride(-1) == 1
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= max_group
        and head_dim <= max_head_dim
    )


def cpu_decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padded (padding is never read)
    context_lens: torch.Tensor,  # [B] int32, each >= 1
    scale: float,
    slots: torch.Tensor | None = None,  # unused: the torch path's gather indices
    mask: torch.Tensor | None = None,  # unused
) -> torch.Tensor:  # [B, num_heads, head_dim]
    """The C twin of ``paged_decode_attention``; falls back to it for inputs the kernel does not handle."""
    if not supports(query, k_cache, v_cache):
        return paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, slots, mask)
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(batch, num_heads, head_dim, dtype=query.dtype)
    if batch == 0:
        return out
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    _lib.paged_decode_attention(
        query.data_ptr(), query.stride(0), query.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        batch, num_heads, num_kv_heads, head_dim, block_size, scale, tables.shape[1] * block_size,
        out.data_ptr(), out.stride(0), out.stride(1), _DTYPE_CODES[query.dtype], torch.get_num_threads(),
    )
    return out


def cpu_rope_paged_attention(
    qkv: torch.Tensor,  # [T, (num_heads + 2 num_kv_heads) head_dim]; q and k are rotated in place
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [max_len, head_dim]
    sin_signed: torch.Tensor,  # [max_len, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    num_heads: int,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """The C twin of ``rope_paged_attention``: rotary embedding, K/V write and the decodes' attention in one call (the
    prefill chunks, if any, then attend in torch); falls back to the torch reference for inputs it does not handle."""
    num_tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
    num_kv_heads = k_cache.shape[2]
    query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    if not (
        qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
        and supports(query, k_cache, v_cache) and cos.dtype == sin_signed.dtype == qkv.dtype
        and cos.is_contiguous() and sin_signed.is_contiguous() and cos.shape[1] == head_dim
        and positions.dtype == meta.slot_mapping.dtype == torch.int64
    ):
        cpu_attention = functools.partial(paged_attention, decode_fn=cpu_decode_attention)
        return rope_paged_attention(qkv, positions, cos, sin_signed, k_cache, v_cache, meta, num_heads, cpu_attention)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype)
    tables, lens = meta.block_tables.to(torch.int32).contiguous(), meta.context_lens.to(torch.int32).contiguous()
    positions, slots = positions.contiguous(), meta.slot_mapping.contiguous()
    block_size = k_cache.shape[1]
    _lib.rope_paged_attention(
        qkv.data_ptr(), qkv.stride(0), num_tokens, positions.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(),
        slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), meta.num_decode_tokens, tables.data_ptr(), tables.stride(0), lens.data_ptr(), num_heads,
        num_kv_heads, head_dim, block_size, meta.scale, tables.shape[1] * block_size, out.data_ptr(), out.stride(0),
        out.stride(1), _DTYPE_CODES[qkv.dtype], torch.get_num_threads(),
    )
    if meta.prefills:  # q and k were rotated in place and every token's K/V is in the cache
        qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_heads + num_kv_heads, head_dim)
        value = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
        attend_prefills(out, qk[:, :num_heads], qk[:, num_heads:], value, k_cache, v_cache, meta)
    return out


def cpu_rms_norm(
    x: torch.Tensor,  # [T, D], rows may be strided
    normalized_shape: tuple[int, ...],  # (D,), as F.rms_norm takes it
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:  # [T, D]
    """``weight * round(x / rms(x))`` as HF's LlamaRMSNorm computes it; falls back to ``F.rms_norm``."""
    lib = load()
    if (
        lib is None
        or x.dim() != 2
        or x.device.type != "cpu"
        or x.dtype not in _DTYPE_CODES
        or weight.dtype != x.dtype
        or x.stride(-1) != 1
        or not weight.is_contiguous()
        or x.shape[1] > lib.limits[2]
    ):
        return F.rms_norm(x, normalized_shape, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.rms_norm(
        x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
        _DTYPE_CODES[x.dtype], torch.get_num_threads(),
    )
    return out


LINEAR_MAX_ROWS = 64  # linear_small's limit; the model decides below which row count it pays (model.small_rows_limit)
LINEAR_OPS = {"none": 0, "silu": 1, "mul": 2, "add": 3}


def prepare_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight as :func:`cpu_linear_small` reads it (packed in blocks of 4 rows where the build wants that), or
    None where it cannot take this weight (not bf16 on CPU, or a shape the packed layout does not fit)."""
    lib = load()
    if (lib is None or weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2
            or weight.shape[1] > 16384):
        return None
    weight = weight.contiguous()
    if not lib.linear_weight_packed():
        return weight
    n, k = weight.shape
    if n % 4 or k % 32:
        return None
    packed = torch.empty_like(weight)
    lib.pack_linear_weight(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def cpu_linear_small(
    x: torch.Tensor,  # [T, K] bf16, T <= LINEAR_MAX_ROWS, rows may be strided
    weight: torch.Tensor,  # [N, K] bf16, from prepare_linear_weight
    bias: torch.Tensor | None = None,  # [N] bf16
    op: str = "none",  # then silu, or times / plus ``other``
    other: torch.Tensor | None = None,  # [T, N] bf16, rows may be strided
) -> torch.Tensor:  # [T, N] bf16
    """``op(x @ weight.T + bias)`` for a decode step's few rows: one pass over the weight, the elementwise op on the
    float32 sum and one rounding (as oneDNN's fused post-ops)."""
    return _fused_linear("linear_small", x, weight, bias, op, other)


def _fused_linear(kernel: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, op: str,
                  other: torch.Tensor | None) -> torch.Tensor:
    """Call a C matmul with linear_small's arguments (``linear_small`` or ``linear_amx``)."""
    num_rows, (n, k) = x.shape[0], weight.shape
    out = torch.empty((num_rows, n), dtype=torch.bfloat16)
    other_ptr, other_stride = (None, 0) if other is None else (other.data_ptr(), other.stride(0))
    status = getattr(_lib, kernel)(
        x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(), num_rows, k, n,
        LINEAR_OPS[op], other_ptr, other_stride, out.data_ptr(), torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"{kernel} cannot take {num_rows} rows of {k}")
    return out


def prepare_linear_weight_amx(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight as :func:`cpu_linear_amx` reads it (AMX tiles' layout), or None where the CPU, the build or the
    shape does not allow it (no AMX, not bf16 on CPU, N % 32 or K % 32)."""
    lib = load()
    if (lib is None or weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2
            or weight.shape[0] % 32 or weight.shape[1] % 32 or weight.shape[1] > 16384
            or not lib.linear_amx_available()):
        return None
    packed = torch.empty_like(weight)
    lib.pack_linear_weight_amx(weight.contiguous().data_ptr(), weight.shape[0], weight.shape[1], packed.data_ptr())
    return packed


def cpu_linear_amx(
    x: torch.Tensor,  # [T, K] bf16, rows may be strided
    weight: torch.Tensor,  # [N, K] bf16, from prepare_linear_weight_amx
    bias: torch.Tensor | None = None,  # [N] bf16
    op: str = "none",  # then silu, or times / plus ``other``
    other: torch.Tensor | None = None,  # [T, N] bf16, rows may be strided
) -> torch.Tensor:  # [T, N] bf16
    """``op(x @ weight.T + bias)`` on AMX tiles, any number of rows: the float32 sum, the elementwise op, one
    rounding (as oneDNN's fused post-ops)."""
    return _fused_linear("linear_amx", x, weight, bias, op, other)


class DecodeStack:
    """``decode_stack``'s view of a model: every layer of a small decode-only step in one C call (the weights'
    addresses gathered once, the step's metadata converted once instead of once per layer).

    ``layers`` are ``backend.engine.model.Layer`` objects whose projections all have a ``small_rows_weight``."""

    def __init__(self, layers: list, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float) -> None:
        def pointers(tensors: list[torch.Tensor | None]) -> ctypes.Array:
            return (ctypes.c_void_p * len(tensors))(*(None if t is None else t.data_ptr() for t in tensors))

        self._keep = layers  # the pointers below are into these layers' tensors
        self.num_layers, self.hidden_size, self.intermediate_size = len(layers), hidden_size, intermediate_size
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps
        self.norm1 = pointers([layer.input_norm for layer in layers])
        self.norm2 = pointers([layer.post_norm for layer in layers])
        self.qkv = pointers([layer.qkv.small_rows_weight for layer in layers])
        self.qkv_bias = pointers([layer.qkv.bias for layer in layers])
        self.o = pointers([layer.o.small_rows_weight for layer in layers])
        self.gate = pointers([layer.gate.small_rows_weight for layer in layers])
        self.up = pointers([layer.up.small_rows_weight for layer in layers])
        self.down = pointers([layer.down.small_rows_weight for layer in layers])
        # Bigger steps read the AMX copies, where every projection has one (else the model keeps the stack to the
        # rows linear_small takes)
        amx = [[getattr(layer, p).amx_weight for layer in layers] for p in ("qkv", "o", "gate", "up", "down")]
        self.takes_amx = all(w is not None for ws in amx for w in ws)
        self.qkv_amx, self.o_amx, self.gate_amx, self.up_amx, self.down_amx = (
            pointers(ws if self.takes_amx else [None] * len(layers)) for ws in amx)
        # (first K pool's address, whether the pools fit the kernels, K pointers, V pointers), built on first use:
        # the pools live as long as the engine
        self._pools: tuple = ()

    @classmethod
    def for_layers(cls, layers: list, shape, dtype: torch.dtype) -> DecodeStack | None:
        """The stack for these layers, or None where the C path cannot run them all (see the class docstring)."""
        if load() is None or dtype != torch.bfloat16 or not layers:
            return None
        projections = [p for layer in layers for p in (layer.qkv, layer.o, layer.gate, layer.up, layer.down)]
        if any(p.small_rows_weight is None for p in projections):
            return None
        max_group, max_head_dim, max_row = _lib.limits
        if (shape.num_heads % shape.num_kv_heads or shape.num_heads // shape.num_kv_heads > max_group
                or shape.head_dim > max_head_dim or shape.hidden_size > max_row):
            return None
        return cls(layers, shape.hidden_size, shape.intermediate_size, shape.num_heads, shape.num_kv_heads,
                   shape.head_dim, shape.rms_norm_eps)

    def __call__(
        self,
        h: torch.Tensor,  # [T, hidden] bf16 contiguous residual stream, updated in place
        positions: torch.Tensor,  # [T] int64
        cos: torch.Tensor,  # [max_len, head_dim]
        sin_signed: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V) [num_blocks, block_size, kvh, hd]
        meta: AttentionMetadata,  # decode-only: every token is a decode
        small_rows: int,  # up to this many rows the projections run cpu_linear_small, above it cpu_linear_amx
    ) -> bool:
        """Run every layer over ``h``; False (nothing done) where the pools or inputs are not what the kernels take."""
        num_tokens = h.shape[0]
        k_cache = kv_caches[0][0]
        if not self._pools or self._pools[0] != k_cache.data_ptr():
            fits = all(k.dtype == v.dtype == h.dtype and k.stride() == v.stride() == k_cache.stride()
                       and k.stride(-1) == 1 for k, v in kv_caches)
            self._pools = (k_cache.data_ptr(), fits,
                           (ctypes.c_void_p * self.num_layers)(*(k.data_ptr() for k, _ in kv_caches)),
                           (ctypes.c_void_p * self.num_layers)(*(v.data_ptr() for _, v in kv_caches)))
        if not (self._pools[1] and h.dtype == cos.dtype == sin_signed.dtype == torch.bfloat16 and h.is_contiguous()
                and cos.is_contiguous() and sin_signed.is_contiguous() and positions.dtype == torch.int64
                and num_tokens <= LINEAR_MAX_ROWS):
            return False
        q_size = self.num_heads * self.head_dim
        qkv_size = q_size + 2 * self.num_kv_heads * self.head_dim
        x = torch.empty_like(h)
        qkv = torch.empty(num_tokens, qkv_size, dtype=h.dtype)
        attn = torch.empty(num_tokens, q_size, dtype=h.dtype)
        gate = torch.empty(num_tokens, self.intermediate_size, dtype=h.dtype)
        up = torch.empty_like(gate)
        tables, lens = meta.block_tables.to(torch.int32).contiguous(), meta.context_lens.to(torch.int32).contiguous()
        positions, slots = positions.contiguous(), meta.slot_mapping.contiguous()
        block_size = k_cache.shape[1]
        status = _lib.decode_stack(
            h.data_ptr(), num_tokens, self.hidden_size, self.num_layers, self.norm1, self.qkv, self.qkv_bias, self.o,
            self.norm2, self.gate, self.up, self.down, self.qkv_amx, self.o_amx, self.gate_amx, self.up_amx,
            self.down_amx, small_rows, self.intermediate_size, self.eps, positions.data_ptr(),
            cos.data_ptr(), sin_signed.data_ptr(), slots.data_ptr(), self._pools[2], self._pools[3],
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.data_ptr(), tables.stride(0),
            lens.data_ptr(), self.num_heads, self.num_kv_heads, self.head_dim, block_size, meta.scale,
            tables.shape[1] * block_size, x.data_ptr(), qkv.data_ptr(), attn.data_ptr(), gate.data_ptr(),
            up.data_ptr(), torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"decode_stack cannot take {num_tokens} rows")
        return True


def supports_sampling(logits: torch.Tensor) -> bool:
    """Whether :func:`cpu_sample_rows` handles these logits (else the sampler uses its torch twin)."""
    return (
        load() is not None and logits.device.type == "cpu" and logits.dtype in _DTYPE_CODES and logits.dim() == 2
        and logits.stride(-1) == 1 and logits.shape[1] > 0
    )


def cpu_sample_rows(
    logits: torch.Tensor,  # [S, V] float32 or bfloat16, rows may be strided; only the sampled rows are read
    settings: torch.Tensor,  # [R, 4] float64: each row's temperature, top_k, top_p, uniform (see sampler.SETTINGS)
    rows: torch.Tensor | None = None,  # [R] int64, which rows of logits to sample; None: the first R
) -> torch.Tensor:  # [R] int64
    """The C twin of ``backend.engine.sampler.sample_rows``; the caller checks :func:`supports_sampling` first."""
    num_rows = settings.shape[0]
    out = torch.empty(num_rows, dtype=torch.int64)
    if num_rows:
        settings = settings.to(torch.float64).contiguous()
        rows = None if rows is None else rows.to(torch.int64).contiguous()
        _lib.sample_rows(
            logits.data_ptr(), logits.stride(0), _DTYPE_CODES[logits.dtype], logits.shape[1],
            None if rows is None else rows.data_ptr(), num_rows, settings.data_ptr(), out.data_ptr(),
            torch.get_num_threads(),
        )
    return out
