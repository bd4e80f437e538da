"""Attention over the paged KV cache: one interface (``base.AttentionBackend``), one backend per file, and the choice.

- ``torch_backend``: the torch reference, the plain path every other backend is compared with;
- ``cpu_backend``: the C kernels (``backend.kernels.cpu_kernels``), on a CPU where they build;
- ``triton_backend``: the OpenAI Triton kernels (``backend/kernels``), on CUDA.

The model runner builds the step's :class:`AttentionMetadata` once, the backend extends it with what it reads, and the
model calls the backend's ``forward`` in every layer.
"""

from __future__ import annotations

import torch

from backend.engine.attention.base import AttentionBackend, AttentionMetadata, PrefillChunk
from backend.engine.attention.cpu_backend import CpuAttention
from backend.engine.attention.torch_backend import TorchAttention
from backend.kernels import cpu_kernels

__all__ = ["AttentionBackend", "AttentionMetadata", "CpuAttention", "PrefillChunk", "TorchAttention",
           "select_attention_backend"]


def select_attention_backend(device: torch.device) -> AttentionBackend:
    """The device decides: the OpenAI Triton kernels on CUDA, the C kernels on a CPU where they build, else the
    torch reference."""
    if device.type == "cuda":
        from backend.engine.attention.triton_backend import TritonAttention  # imports triton

        return TritonAttention()
    return CpuAttention() if cpu_kernels.load() is not None else TorchAttention()
