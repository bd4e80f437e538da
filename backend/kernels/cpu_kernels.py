"""C twins of torch hot spots, for CPUs: built at first use, loaded with ctypes.

Each function is a tensor operation with a torch twin (same inputs, same result within float rounding) and refuses
(``ValueError``) inputs it cannot take, so a test that calls it knows the C code ran; the engine checks ``supports*``
and picks the twin. Nothing here knows the engine: the attention backends, the model's routing of projections and
the decode stack's use live in ``backend/engine``.

- ``cpu_decode_attention``: decode attention over the paged pool, read in place through the block tables (the torch
  twin first copies every sequence's K/V out of the pool, once per layer).
- ``cpu_rope_paged_attention``: one layer from its QKV projection in one call: rotary embedding on q and k (in
  place), the K/V write and the decodes' attention, where the torch ops take a dozen calls.
- ``cpu_rms_norm``: HF's LlamaRMSNorm in one pass per row (``F.rms_norm`` on bf16 runs eight tensor ops).
- ``cpu_linear_small`` and ``cpu_linear_amx``: ``op(x @ W.T + b)``, both from one copy of the weight laid out for
  them (``prepare_linear_weight``; ``linear_weight_rows`` reads rows back, e.g. a tied embedding's);
  :class:`DecodeStack` runs every layer of a small decode-only step in one call.
- ``cpu_sample_rows``: the sampler's draw, one pass over each row.
- ``cpu_token_logprobs``: the sampled tokens' log-probabilities and each row's top k, without a log-softmax.
- ``cpu_apply_token_bitmask``: structured output's token masks written into the logits (-inf where forbidden).
- The quantized projections' kernels (``linear_q4_1``, ``linear_int8``, ``linear_q8_0``, ``dequantize_weight``) are
  declared here and called from ``quantized_linear.py``, beside their torch twins.

The shared library is compiled from the C files in ``cpu/`` with the system C compiler (``$CC``, default ``cc``) into
``$XDG_CACHE_HOME/llm-batching-triton`` (keyed by every source file, the flags and the CPU), once per machine (a few
seconds), for ``-march=native`` (``LLM_CPU_MARCH`` names another target, e.g. ``x86-64-v2``: the tests build one
without AVX-512). Without a compiler, on a non-glibc system, or with ``LLM_CPU_KERNELS=0``, :func:`load` returns
``None`` and the engine keeps the torch code.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from backend.contract.settings import CPU_KERNELS_ENV_VAR, CPU_MARCH_ENV_VAR
from backend.kernels.weight_format import WeightFormat

log = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).with_name("cpu")
# -ffast-math lets the compiler vectorise the float dot products (reassociation); inputs are finite by construction.
_MARCH = os.environ.get(CPU_MARCH_ENV_VAR, "native")
_FLAGS = ("-O3", "-mprefer-vector-width=512", "-Wno-psabi", "-ffast-math", "-fopenmp", "-shared", "-fPIC")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_loaded = False


class Limits(NamedTuple):
    """The shapes the C kernels take, as the library exports them (``cpu/common.h``)."""

    max_group: int  # query heads per KV head (attention)
    max_head_dim: int  # attention
    max_row: int  # hidden size (rms_norm, decode_stack)
    linear_max_rows: int  # rows of x (linear_small, decode_stack)
    linear_max_k: int  # columns of x (linear_small, linear_amx)


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or ``None`` when it cannot be built here (the torch path is used instead)."""
    global _lib, _loaded
    with _lock:
        if not _loaded:
            _loaded = True
            if os.environ.get(CPU_KERNELS_ENV_VAR, "1") == "0":
                return None
            try:
                _lib = _build_and_load()
            except (OSError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", b"") or b""
                log.warning("CPU kernels unavailable, using the torch path: %s %s", exc, detail.decode()[-500:])
        return _lib


def limits() -> Limits | None:
    """What the library takes, or ``None`` without it."""
    lib = load()
    return None if lib is None else lib.limits


def cache_dir() -> Path:
    """Where the library (and what else is built once per machine) is kept: ``$XDG_CACHE_HOME/llm-batching-triton``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llm-batching-triton"


def library_key() -> str | None:
    """The loaded library's key (its sources, flags, compiler and this CPU), or ``None`` without it."""
    lib = load()
    return None if lib is None else lib.key


def _sources() -> list[Path]:
    return sorted(p for p in _SOURCE_DIR.iterdir() if p.suffix in (".c", ".h"))


def compiler() -> str:
    """The C compiler that builds the library: ``$CC``, else ``cc``."""
    return os.environ.get("CC", "cc")


def compile_library(dest: Path, march: str = _MARCH) -> None:
    """Compile every C file in ``cpu/`` into the shared library ``dest`` for ``-march=march`` (raises
    ``subprocess.CalledProcessError`` with the compiler's output when it fails). The tests also build for targets
    this machine is not, so that code behind ``#if defined(__AVX512BF16__)`` and the like still compiles here."""
    c_files = [str(p) for p in _sources() if p.suffix == ".c"]
    subprocess.run([compiler(), f"-march={march}", *_FLAGS, *c_files, "-o", str(dest), "-lm"],
                   check=True, capture_output=True, timeout=300)


def _build_and_load() -> ctypes.CDLL:
    parts = [part for path in _sources() for part in (path.name.encode(), path.read_bytes())]
    flags = " ".join((f"-march={_MARCH}", *_FLAGS)).encode()
    key = hashlib.sha256(b"\0".join([*parts, flags, compiler().encode(), _cpu_id()])).hexdigest()
    cache = cache_dir()
    path = cache / f"cpu_kernels-{key[:16]}.so"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build aside, then rename: safe with parallel builders
            built = Path(tmp) / path.name
            compile_library(built)
            os.replace(built, path)
    lib = ctypes.CDLL(str(path))  # torch is imported first, so libgomp.so.1 resolves to torch's own OpenMP runtime
    lib.key = key[:16]
    _declare(lib)
    lib.limits = Limits(lib.max_group(), lib.max_head_dim(), lib.max_row(), lib.linear_max_rows(),
                        lib.linear_max_k())
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """The C functions' argument and result types."""
    i64, ptr, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.paged_decode_attention.argtypes = [
        ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr,  # query, caches, block tables, context lens
        i64, i64, i64, i64, i64, c_float, i64,  # B, H, KVH, D, block_size, scale, max_context
        ptr, i64, i64, c_int, c_int,  # out, dtype, num_threads
    ]
    lib.paged_decode_attention.restype = None
    lib.set_decode_attention_widened.argtypes, lib.set_decode_attention_widened.restype = [c_int], c_int
    lib.rope_paged_attention.argtypes = [
        ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64,  # qkv, positions, tables, slots, caches
        i64, ptr, i64, ptr, i64, i64, i64, i64, c_float, i64,  # decodes, block tables, H, KVH, D, scale
        ptr, i64, i64, c_int, c_int,  # out, dtype, num_threads
    ]
    lib.rope_paged_attention.restype = None
    lib.prefill_attention.argtypes = [
        ptr, i64, ptr, ptr, i64, i64, i64, i64,  # qkv, caches, their strides, block_size
        ptr, i64, ptr, i64, i64, i64, c_float,  # chunks, slots, H, KVH, D, scale
        ptr, i64, i64, c_int, c_int,  # out, dtype, num_threads
    ]
    lib.prefill_attention.restype = c_int
    lib.prefill_attention_available.restype = c_int
    lib.rms_norm.argtypes = [ptr, i64, ptr, ptr, i64, i64, c_float, c_int, c_int]
    lib.rms_norm.restype = None
    lib.sample_rows.argtypes = [ptr, i64, c_int, i64, ptr, i64, ptr, ptr, c_int]
    lib.sample_rows.restype = None
    lib.token_logprobs.argtypes = [ptr, i64, c_int, i64, ptr, i64, ptr, ptr, c_int, ptr, ptr, ptr, ptr, c_int]
    lib.token_logprobs.restype = None
    lib.apply_token_bitmask.argtypes = [ptr, i64, c_int, i64, ptr, ptr, i64, i64]
    lib.apply_token_bitmask.restype = None
    lib.linear_small.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, c_int, ptr, i64, ptr, c_int]
    lib.linear_small.restype = c_int
    lib.linear_weight_packed.restype = c_int
    lib.linear_row_major_any_rows.restype = c_int
    lib.set_linear_panel_rows.argtypes, lib.set_linear_panel_rows.restype = [c_int], c_int
    lib.decode_stack.argtypes = [
        ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr,  # h, weights per layer
        c_int, i64, i64, c_float,  # weight format, small_rows, I, eps
        ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64,  # positions, cos, sin, slots, K and V pools per layer, strides
        ptr, i64, ptr, i64, i64, i64, i64, c_float, i64,  # block tables, context lens, H, KVH, D, ...
        ptr, ptr, ptr, ptr, ptr, c_int,  # scratch: x, qkv, attn, gate, up; num_threads
    ]
    lib.decode_stack.restype = c_int
    lib.pack_linear_weight.argtypes = [ptr, i64, i64, ptr]
    lib.pack_linear_weight.restype = None
    lib.linear_amx.argtypes = lib.linear_small.argtypes
    lib.linear_amx.restype = c_int
    lib.linear_amx_available.restype = c_int
    for quantized in (lib.linear_q4_1, lib.linear_int8, lib.linear_q8_0):  # quantized_linear.py
        quantized.argtypes, quantized.restype = lib.linear_small.argtypes, c_int
    lib.dequantize_weight.argtypes = [c_int, ptr, i64, i64, ptr, c_int]
    lib.dequantize_weight.restype = c_int
    lib.quant_kernel_path.argtypes, lib.quant_kernel_path.restype = [c_int, i64, i64, i64], c_int
    for limit in (lib.max_group, lib.max_head_dim, lib.max_row, lib.linear_max_rows, lib.linear_max_k):
        limit.restype = c_int


def _cpu_id() -> bytes:
    """-march=native code is only valid on the CPU it was built for: key the cache by model name and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b""
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted).encode()


# ---- attention ----------------------------------------------------------------------------------------------------


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the attention kernels take these tensors (else the caller runs the torch twin)."""
    lib = load()
    if lib is None or query.device.type != "cpu" or query.dtype not in _DTYPE_CODES:
        return False
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    return (
        k_cache.dtype == v_cache.dtype == query.dtype
        and k_cache.stride() == v_cache.stride()
        and query.stride(-1) == k_cache.stride(-1) == 1
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= lib.limits.max_group
        and head_dim <= lib.limits.max_head_dim
    )


def _refuse(kernel: str) -> ValueError:
    return ValueError(f"{kernel} cannot take these tensors (see cpu_kernels.supports*); run its torch twin")


def cpu_decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padded (padding is never read)
    context_lens: torch.Tensor,  # [B] int32, each >= 1
    scale: float,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    """The C twin of the torch reference's ``paged_decode_attention``, for the tensors :func:`supports` accepts."""
    if not supports(query, k_cache, v_cache):
        raise _refuse("cpu_decode_attention")
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


def set_decode_attention_widened(widened: bool) -> bool:
    """Whether the decode attention (``cpu_decode_attention``, ``cpu_rope_paged_attention``) widens each tile of a bf16
    pool's K and V rows to float32 before using them, as it did before it read them in place
    (``python -m bench.decode_attention``'s baseline); off by default. The whole library, from the next call.
    Returns the setting it replaced."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU kernel library is not loaded here (cpu_kernels.load() returned None)")
    return bool(lib.set_decode_attention_widened(int(widened)))


def supports_rope_attention(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, slot_mapping: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
) -> bool:
    """Whether :func:`cpu_rope_paged_attention` takes these tensors."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    query = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
    return (
        qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
        and supports(query, k_cache, v_cache) and cos.dtype == sin_signed.dtype == qkv.dtype
        and cos.is_contiguous() and sin_signed.is_contiguous() and cos.shape[1] == head_dim
        and positions.dtype == slot_mapping.dtype == torch.int64
    )


def cpu_rope_paged_attention(
    qkv: torch.Tensor,  # [T, (num_heads + 2 num_kv_heads) head_dim]; q and k are rotated in place
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [max_len, head_dim]
    sin_signed: torch.Tensor,  # [max_len, head_dim]: [-sin_lo, sin_hi]
    slot_mapping: torch.Tensor,  # [T] int64: where each token's K/V is written (negative: nowhere)
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_decodes, max_blocks] int32, padded
    context_lens: torch.Tensor,  # [num_decodes] int32
    num_decodes: int,  # the first num_decodes tokens are single-token decodes
    scale: float,
    num_heads: int,
) -> torch.Tensor:  # [T, num_heads, head_dim]: the decodes' rows written, the others left for the caller
    """One layer from its QKV projection: rotary embedding on q and k (in place in ``qkv``), every token's K/V
    written to the pool, then the decodes' attention, in one call. Its torch twin is the reference's rotation,
    ``write_kv`` and ``paged_decode_attention``; the prefill chunks' attention is the caller's."""
    if not supports_rope_attention(qkv, positions, cos, sin_signed, slot_mapping, k_cache, v_cache, num_heads):
        raise _refuse("cpu_rope_paged_attention")
    num_tokens = qkv.shape[0]
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype)
    tables, lens = block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous()
    positions, slots = positions.contiguous(), slot_mapping.contiguous()
    _lib.rope_paged_attention(
        qkv.data_ptr(), qkv.stride(0), num_tokens, positions.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(),
        slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), num_decodes, tables.data_ptr(), tables.stride(0), lens.data_ptr(), num_heads,
        num_kv_heads, head_dim, block_size, scale, tables.shape[1] * block_size, out.data_ptr(), out.stride(0),
        out.stride(1), _DTYPE_CODES[qkv.dtype], torch.get_num_threads(),
    )
    return out


def prefill_attention_available() -> bool:
    """Whether the library has the prefill kernel: it is built for vdpbf16ps (AVX512-BF16), or for AVX2 and FMA in
    float32."""
    lib = load()
    return lib is not None and bool(lib.prefill_attention_available())


def supports_prefill_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> bool:
    """Whether :func:`cpu_prefill_attention` takes these tensors: bf16, heads of a multiple of 64 dimensions, and a
    build with the kernel (AVX512-BF16, or AVX2 and FMA); else the caller runs the torch twin."""
    if not prefill_attention_available():
        return False
    lib = load()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    return (
        qkv.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16 and qkv.device.type == "cpu"
        and qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
        and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
        and num_heads % num_kv_heads == 0 and head_dim % 64 == 0 and head_dim <= lib.limits.max_head_dim
    )


def prefill_plan(prefills, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`cpu_prefill_attention` reads about a step's prefill chunks, built once per step: ``chunks``
    [num_chunks, 4] int64 (first token in the step, query tokens, cached tokens, offset into ``slots``) and ``slots``,
    each chunk's whole context's pool slots in order (a fresh chunk's are its own tokens' slots)."""
    rows, context, offset = [], [], 0
    for chunk in prefills:
        own = slot_mapping[chunk.token_start: chunk.token_start + chunk.num_query_tokens]
        slots = own if chunk.context_slots is None else chunk.context_slots
        rows.append((chunk.token_start, chunk.num_query_tokens, chunk.num_cached_tokens, offset))
        context.append(slots.to(torch.int64))
        offset += len(slots)
    return torch.tensor(rows, dtype=torch.int64).view(-1, 4), torch.cat(context).contiguous()


def cpu_prefill_attention(
    out: torch.Tensor,  # [T, num_heads, head_dim]: each chunk's rows written
    qkv: torch.Tensor,  # [T, (num_heads + 2 num_kv_heads) head_dim], q already rotated (cpu_rope_paged_attention)
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], every token's K/V already written
    v_cache: torch.Tensor,
    plan: tuple[torch.Tensor, torch.Tensor],  # prefill_plan's chunks and slots
    scale: float,
    num_heads: int,
) -> None:
    """The C twin of the torch reference's ``attend_prefills``: every prefill chunk of the step attends to its
    cached prefix and itself, causally, reading K and V from the pool, for the tensors
    :func:`supports_prefill_attention` accepts."""
    if not supports_prefill_attention(qkv, k_cache, v_cache, num_heads) or out.stride(2) != 1:
        raise _refuse("cpu_prefill_attention")
    chunks, slots = plan
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    done = _lib.prefill_attention(
        qkv.data_ptr(), qkv.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_size, chunks.data_ptr(), chunks.shape[0], slots.data_ptr(), num_heads,
        num_kv_heads, head_dim, scale, out.data_ptr(), out.stride(0), out.stride(1), _DTYPE_CODES[qkv.dtype],
        torch.get_num_threads(),
    )
    if done != 0:
        raise _refuse("cpu_prefill_attention")


# ---- norms and projections ----------------------------------------------------------------------------------------


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    lib = load()
    return (
        lib is not None and x.dim() == 2 and x.device.type == "cpu" and x.dtype in _DTYPE_CODES
        and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.is_contiguous()
        and x.shape[1] <= lib.limits.max_row
    )


def cpu_rms_norm(
    x: torch.Tensor,  # [T, D], rows may be strided
    normalized_shape: tuple[int, ...],  # (D,), as F.rms_norm takes it
    weight: torch.Tensor,  # [D]
    eps: float,
) -> torch.Tensor:  # [T, D]
    """``weight * round(x / rms(x))`` as HF's LlamaRMSNorm computes it (``F.rms_norm``'s signature)."""
    if not supports_rms_norm(x, weight):
        raise _refuse("cpu_rms_norm")
    out = torch.empty(x.shape, dtype=x.dtype)
    _lib.rms_norm(
        x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
        _DTYPE_CODES[x.dtype], torch.get_num_threads(),
    )
    return out


LINEAR_OPS = {"none": 0, "silu": 1, "mul": 2, "add": 3}


def prepare_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight as :func:`cpu_linear_small` and :func:`cpu_linear_amx` read it, or None where they cannot take it
    (not bf16 on CPU, or a shape the packed layout does not fit). Where the build reads it packed
    (:func:`weight_packed`), a copy in the AMX tiles' layout, [N/16][K/32][16 pairs of k][16 n][2]; else row-major."""
    lib = load()
    if (lib is None or weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2
            or weight.shape[1] > lib.limits.linear_max_k):
        return None
    weight = weight.contiguous()
    if not lib.linear_weight_packed():
        return weight
    n, k = weight.shape
    if n % 32 or k % 32:
        return None
    packed = torch.empty_like(weight)
    lib.pack_linear_weight(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def weight_packed() -> bool:
    """Whether :func:`prepare_linear_weight` packs (builds with AVX512-BF16) or keeps the weight row-major."""
    lib = load()
    return lib is not None and bool(lib.linear_weight_packed())


def row_major_any_rows() -> bool:
    """Whether :func:`cpu_linear_small` takes a row-major weight at any row count (builds with AVX2 and FMA but no
    AVX512-BF16: ``linear_rows_avx2`` runs the many rows), not only up to ``limits().linear_max_rows``."""
    lib = load()
    return lib is not None and bool(lib.linear_row_major_any_rows())


def set_linear_panel_rows(rows: int) -> int:
    """From how many rows a row-major weight runs ``linear_rows_avx2``'s panels instead of one pass in registers
    (``rows`` <= 1: always); returns the count it replaced, -1 in a build without them. The benches' and tests'
    switch."""
    return _lib.set_linear_panel_rows(rows)


def linear_weight_dense(prepared: torch.Tensor) -> torch.Tensor:  # [N, K] row-major
    """W back from :func:`prepare_linear_weight`'s copy (a new tensor where it is packed): the torch twins' input."""
    if not weight_packed():
        return prepared
    n, k = prepared.shape
    return prepared.view(n // 16, k // 32, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(n, k)


def linear_weight_rows(prepared: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # [len(rows), K]
    """Rows of W read back from :func:`prepare_linear_weight`'s copy: a tied embedding looks its tokens up in the LM
    head's weight instead of keeping a second copy."""
    if not weight_packed():
        return prepared.index_select(0, rows)
    n, k = prepared.shape
    tiles = prepared.view(n // 16, k // 32, 16, 16, 2)  # [N/16][K/32][pair][n][2]
    return tiles[rows // 16, :, :, rows % 16, :].reshape(len(rows), k)


def cpu_linear_small(
    x: torch.Tensor,  # [T, K] bf16, rows may be strided; where W is row-major, T <= limits().linear_max_rows
    # unless row_major_any_rows()
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
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1 or (other is not None and other.stride(-1) != 1):
        raise _refuse(kernel)
    out = torch.empty((num_rows, n), dtype=torch.bfloat16)
    other_ptr, other_stride = (None, 0) if other is None else (other.data_ptr(), other.stride(0))
    status = getattr(_lib, kernel)(
        x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(), num_rows, k, n,
        LINEAR_OPS[op], other_ptr, other_stride, out.data_ptr(), torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"{kernel} cannot take {num_rows} rows of {k}")
    return out


def has_amx() -> bool:
    """Whether :func:`cpu_linear_amx` runs here (the CPU has AMX, Linux grants it, the build has it)."""
    lib = load()
    return lib is not None and bool(lib.linear_amx_available())


def cpu_linear_amx(
    x: torch.Tensor,  # [T, K] bf16, rows may be strided
    weight: torch.Tensor,  # [N, K] bf16, from prepare_linear_weight (packed)
    bias: torch.Tensor | None = None,  # [N] bf16
    op: str = "none",  # then silu, or times / plus ``other``
    other: torch.Tensor | None = None,  # [T, N] bf16, rows may be strided
) -> torch.Tensor:  # [T, N] bf16
    """``op(x @ weight.T + bias)`` on AMX tiles, any number of rows: the float32 sum, the elementwise op, one
    rounding (as oneDNN's fused post-ops)."""
    return _fused_linear("linear_amx", x, weight, bias, op, other)


# ---- every layer of a small decode step ----------------------------------------------------------------------------


class StackLayer(NamedTuple):
    """One decoder layer's tensors as ``decode_stack`` reads them: the norms' weights and the projections as
    ``prepare_linear_weight`` lays them out."""

    input_norm: torch.Tensor  # [D]
    qkv: torch.Tensor  # [(H + 2 KVH) hd, D]
    qkv_bias: torch.Tensor | None  # [(H + 2 KVH) hd]
    o: torch.Tensor  # [D, H hd]
    post_norm: torch.Tensor  # [D]
    gate: torch.Tensor  # [I, D]
    up: torch.Tensor  # [I, D]
    down: torch.Tensor  # [D, I]


class DecodeStack:
    """Every layer of a small decode-only step in one C call (``decode_stack``): per layer RMSNorm, QKV,
    rotary embedding + K/V write + decode attention, O plus the residual, RMSNorm, SiLU(gate) * up, down plus the
    residual, from the same C functions as the calls above, so the result is the same to the bit. The weights'
    addresses are gathered once."""

    # how the projections' weights may be held: bf16 in prepare_linear_weight's layout, or quantized_linear's
    WEIGHT_FORMATS = (WeightFormat.BF16, WeightFormat.Q4_1, WeightFormat.INT8)

    def __init__(self, layers: list[StackLayer], hidden_size: int, intermediate_size: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, eps: float,
                 weight_format: WeightFormat = WeightFormat.BF16) -> None:
        def pointers(tensors: list[torch.Tensor | None]) -> ctypes.Array:
            return (ctypes.c_void_p * len(tensors))(*(None if t is None else t.data_ptr() for t in tensors))

        if load() is None:
            raise ValueError("DecodeStack needs the C kernels")
        self._keep = layers  # the pointers below are into these tensors
        self.num_layers, self.hidden_size, self.intermediate_size = len(layers), hidden_size, intermediate_size
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = num_heads, num_kv_heads, head_dim, eps
        self.weight_format = WeightFormat.parse(weight_format, self.WEIGHT_FORMATS, "weight_format")
        self.norm1, self.qkv, self.qkv_bias, self.o, self.norm2, self.gate, self.up, self.down = (
            pointers([getattr(layer, name) for layer in layers]) for name in StackLayer._fields)
        # (first K pool's address, whether the pools fit the kernels, K pointers, V pointers), built on first use:
        # the pools live as long as the engine
        self._pools: tuple = ()

    @staticmethod
    def supports(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether the kernels take a model of this shape."""
        lib_limits = limits()
        return (lib_limits is not None and num_heads % num_kv_heads == 0
                and num_heads // num_kv_heads <= lib_limits.max_group and head_dim <= lib_limits.max_head_dim
                and hidden_size <= lib_limits.max_row)

    def __call__(
        self,
        h: torch.Tensor,  # [T, hidden] bf16 contiguous residual stream, updated in place
        positions: torch.Tensor,  # [T] int64
        cos: torch.Tensor,  # [max_len, head_dim]
        sin_signed: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V) [num_blocks, block_size, kvh, hd]
        slot_mapping: torch.Tensor,  # [T] int64
        block_tables: torch.Tensor,  # [T, max_blocks] int32: every token is a decode
        context_lens: torch.Tensor,  # [T] int32
        scale: float,
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
                and num_tokens <= _lib.limits.linear_max_rows):
            return False
        q_size = self.num_heads * self.head_dim
        qkv_size = q_size + 2 * self.num_kv_heads * self.head_dim
        x = torch.empty_like(h)
        qkv = torch.empty(num_tokens, qkv_size, dtype=h.dtype)
        attn = torch.empty(num_tokens, q_size, dtype=h.dtype)
        gate = torch.empty(num_tokens, self.intermediate_size, dtype=h.dtype)
        up = torch.empty_like(gate)
        tables, lens = block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous()
        positions, slots = positions.contiguous(), slot_mapping.contiguous()
        block_size = k_cache.shape[1]
        status = _lib.decode_stack(
            h.data_ptr(), num_tokens, self.hidden_size, self.num_layers, self.norm1, self.qkv, self.qkv_bias, self.o,
            self.norm2, self.gate, self.up, self.down, self.weight_format.c_code,
            min(small_rows, _lib.limits.linear_max_rows), self.intermediate_size, self.eps, positions.data_ptr(),
            cos.data_ptr(), sin_signed.data_ptr(), slots.data_ptr(), self._pools[2], self._pools[3], k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2),
            tables.data_ptr(), tables.stride(0), lens.data_ptr(), self.num_heads, self.num_kv_heads, self.head_dim,
            block_size, scale, tables.shape[1] * block_size, x.data_ptr(), qkv.data_ptr(), attn.data_ptr(),
            gate.data_ptr(), up.data_ptr(), torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"decode_stack cannot take {num_tokens} rows")
        return True


# ---- sampling -----------------------------------------------------------------------------------------------------


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
    """The C twin of the sampler's ``sample_rows``; the caller checks :func:`supports_sampling` first."""
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


def cpu_apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask) -> None:
    """-inf, in place, wherever row i of ``bitmask`` ([len(rows), words] int32, a bit per token, 1: allowed; a
    numpy array) forbids a token of logits row ``rows[i]``; the caller checks :func:`supports_sampling` first."""
    if rows:
        row_ids = torch.tensor(rows, dtype=torch.int64)
        _lib.apply_token_bitmask(logits.data_ptr(), logits.stride(0), _DTYPE_CODES[logits.dtype], logits.shape[1],
                                 row_ids.data_ptr(), bitmask.ctypes.data, bitmask.shape[1], len(rows))


def cpu_token_logprobs(
    logits: torch.Tensor,  # [S, V] float32 or bfloat16, rows may be strided; only the named rows are read
    rows: torch.Tensor,  # [R] int64, which rows of logits
    temperature: torch.Tensor,  # [R] float32, each row's (1 for a greedy row)
    tokens: torch.Tensor,  # [R] int64, each row's sampled token
    k: int,  # how many likeliest tokens per row (0 to 20)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The C twin of the sampler's ``token_logprobs`` math: each row's picked log-probability [R] float32, its rank
    [R] int64, and its top k ids [R, k] int64 and log-probabilities [R, k] float32; the caller checks
    :func:`supports_sampling` first."""
    num_rows = rows.shape[0]
    logprob, rank = torch.empty(num_rows, dtype=torch.float32), torch.empty(num_rows, dtype=torch.int64)
    top_ids, top_vals = torch.empty(num_rows, k, dtype=torch.int64), torch.empty(num_rows, k, dtype=torch.float32)
    if num_rows:
        rows, tokens = rows.to(torch.int64).contiguous(), tokens.to(torch.int64).contiguous()
        inv_t = (1.0 / temperature.to(torch.float32)).contiguous()
        _lib.token_logprobs(
            logits.data_ptr(), logits.stride(0), _DTYPE_CODES[logits.dtype], logits.shape[1], rows.data_ptr(),
            num_rows, inv_t.data_ptr(), tokens.data_ptr(), k, logprob.data_ptr(), rank.data_ptr(),
            top_ids.data_ptr(), top_vals.data_ptr(), torch.get_num_threads(),
        )
    return logprob, rank, top_ids, top_vals
