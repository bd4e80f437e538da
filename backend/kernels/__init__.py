"""OpenAI Triton kernels for attention over the paged KV cache, twins of the torch reference in ``backend.attention``.

Each kernel takes the same inputs as its reference and returns the same result; the device decides which runs:

====================================  ===========================================
``backend.attention`` (torch, CPU)    ``backend.kernels`` (OpenAI Triton, CUDA)
====================================  ===========================================
``write_kv``                          ``cuda_write_kv``
``paged_decode_attention``            ``cuda_decode_attention``
``prefill_attention``                 ``cuda_prefill_attention``
``paged_attention`` (a whole step)    ``cuda_paged_attention``
``TORCH_ATTENTION`` (its backend)     ``TRITON_ATTENTION``
====================================  ===========================================

Under ``TRITON_INTERPRET=1`` (set before this package is first imported) they run on CPU tensors, which is how the
tests check them on a machine without a GPU.
"""

from backend.kernels.decode_attention import cuda_decode_attention
from backend.kernels.paged_attention import TRITON_ATTENTION, cuda_paged_attention
from backend.kernels.prefill_attention import cuda_prefill_attention, paged_prefill_attention
from backend.kernels.reshape_and_cache import cuda_write_kv

__all__ = [
    "TRITON_ATTENTION",
    "cuda_decode_attention",
    "cuda_paged_attention",
    "cuda_prefill_attention",
    "cuda_write_kv",
    "paged_prefill_attention",
]
