"""Kernels for the engine's hot spots, each a twin of a torch reference (same inputs, same result).

The C kernels for the CPU (``cpu_kernels.c``, built at first use by ``cpu_kernels``: RMSNorm, decode attention over
the paged cache, sampling) and the OpenAI Triton kernels for CUDA; the device decides which runs:

=============================================  ==============================================
torch reference (``backend.engine``)           kernel twin
=============================================  ==============================================
``attention.write_kv``                         ``cuda_write_kv``
``attention.paged_decode_attention``           ``cuda_decode_attention``, ``cpu_kernels``
``attention.prefill_attention``                ``cuda_prefill_attention``
``attention.paged_attention`` (a whole step)   ``cuda_paged_attention``
``attention.TORCH_ATTENTION`` (its backend)    ``TRITON_ATTENTION``
``sampler.sample_rows``                        ``cpu_kernels.cpu_sample_rows``
=============================================  ==============================================

The OpenAI Triton names below are loaded on first use, so the CPU path never imports ``triton``. Under
``TRITON_INTERPRET=1`` (set before they are first used) they run on CPU tensors, which is how the tests check them on
a machine without a GPU.
"""

import importlib

_TRITON_KERNELS = {
    "TRITON_ATTENTION": "paged_attention",
    "cuda_paged_attention": "paged_attention",
    "cuda_decode_attention": "decode_attention",
    "cuda_prefill_attention": "prefill_attention",
    "paged_prefill_attention": "prefill_attention",
    "cuda_write_kv": "reshape_and_cache",
}

__all__ = sorted(_TRITON_KERNELS)


def __getattr__(name: str):
    if name not in _TRITON_KERNELS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_TRITON_KERNELS[name]}"), name)
