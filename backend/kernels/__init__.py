"""Kernels for the engine's hot spots: tensor operations, each a twin of a torch reference (same inputs, same result).

Nothing here imports the engine (``backend/engine``): the attention backends there compose these operations, and the
device decides which runs. The C kernels for the CPU (``cpu_kernels``, built at first use from ``cpu/*.c``) and the
OpenAI Triton kernels for CUDA:

==============================================================  ==============================================
torch reference (``backend/engine``)                            kernel twin
==============================================================  ==============================================
``attention/torch_backend.py``: ``write_kv``                    ``cuda_write_kv``
``attention/torch_backend.py``: ``paged_decode_attention``      ``cuda_decode_attention``, ``cpu_kernels``
``attention/torch_backend.py``: ``prefill_attention``           ``paged_prefill_attention`` (every chunk at once)
rotation, ``write_kv`` and decode attention of one layer        ``cpu_kernels.cpu_rope_paged_attention``
``F.rms_norm``, ``F.linear`` with its epilogue                  ``cpu_kernels``
``sampler.py``: ``sample_rows``                                 ``cpu_kernels.cpu_sample_rows``
==============================================================  ==============================================

The OpenAI Triton names below are loaded on first use, so the CPU path never imports ``triton``. Under
``TRITON_INTERPRET=1`` (set before they are first used) they run on CPU tensors, which is how the tests check them on
a machine without a GPU.
"""

import importlib

_TRITON_KERNELS = {
    "cuda_decode_attention": "decode_attention",
    "paged_prefill_attention": "prefill_attention",
    "cuda_write_kv": "reshape_and_cache",
}

__all__ = sorted(_TRITON_KERNELS)


def __getattr__(name: str):
    if name not in _TRITON_KERNELS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_TRITON_KERNELS[name]}"), name)
