"""Turns a scheduler decision into tensors, runs the model over the paged KV cache, and returns logits.

The runner owns the device-side state: the weights and the KV pool (one K and one V tensor per layer).
"""

from __future__ import annotations

import ctypes
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from backend import cpu_kernels
from backend.attention import AttentionMetadata, PrefillChunk, decode_gather_indices, paged_decode_attention
from backend.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from backend.model import LlamaModel, ModelShape
from backend.request import Request

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available; use device=auto or device=cpu")
    return torch.device(device)


def read_model_shape(model_dir: str | Path) -> ModelShape:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model folder {model_dir} has no config.json (prepare one with `make model`)")
    return ModelShape.from_hf_config(json.loads(path.read_text()))


def _keep_freed_memory_in_process() -> None:
    """Let glibc serve large tensors from its heap instead of fresh ``mmap`` pages.

    Each step allocates and frees the same large activations (gathered K/V, MLP outputs) once per layer. By default
    glibc maps every block over its mmap threshold anew and unmaps it on free, so each allocation pays a page fault per
    4 KiB; in a VM that made a batch-64 decode layer's attention 3x slower. Raising the mmap and trim thresholds keeps
    freed memory in the process for reuse (what tcmalloc/jemalloc give vLLM's and IPEX's CPU backends via LD_PRELOAD).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from <malloc.h>
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 30)


@dataclass(frozen=True)
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S]
    sampled_requests: list[Request]  # row i of the logits belongs to sampled_requests[i]


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
            _keep_freed_memory_in_process()
        self.dtype = _TORCH_DTYPES[config.dtype]
        self.shape = read_model_shape(config.model)
        config.resolve(self.shape.max_position_embeddings)
        self.model = LlamaModel(config.model, self.dtype, self.device, config.max_model_len)
        # The device decides which twin of the decode attention runs: the OpenAI Triton kernel on CUDA, the C kernel on
        # a CPU where it builds, else the torch reference.
        if self.device.type == "cuda":
            from backend.kernels import cuda_decode_attention

            self.model.decode_fn = cuda_decode_attention
        elif cpu_kernels.load() is not None:
            self.model.decode_fn = cpu_kernels.cpu_decode_attention
        self.block_size = config.block_size
        self._block_offsets = torch.arange(self.block_size)
        self.num_kv_blocks = self._num_kv_blocks()
        s = self.shape
        cache_shape = (self.num_kv_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        self.kv_caches = [
            (torch.zeros(cache_shape, dtype=self.dtype, device=self.device),
             torch.zeros(cache_shape, dtype=self.dtype, device=self.device))
            for _ in range(s.num_layers)
        ]

    def _num_kv_blocks(self) -> int:
        c, s = self.config, self.shape
        block_bytes = c.kv_block_bytes(s.num_layers, s.num_kv_heads, s.head_dim)
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if c.kv_cache_memory_bytes is not None:
            budget = c.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - (1 - c.gpu_memory_utilization) * total)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(f"the KV-cache budget ({budget} bytes) holds no block of {block_bytes} bytes")
        return num_blocks

    @property
    def kv_cache_bytes(self) -> int:
        s = self.shape
        return self.num_kv_blocks * self.config.kv_block_bytes(s.num_layers, s.num_kv_heads, s.head_dim)

    def prepare(self, scheduled: list[tuple[Request, int]]) -> ModelInput:
        """Flatten the step into one token stream: single-token decodes first, then prefill chunks."""
        bs = self.block_size
        decodes = [r for r, n in scheduled if n == 1]
        chunks = [(r, n) for r, n in scheduled if n > 1]
        # Single tokens (decodes, and one-token prompt chunks) at position num_computed_tokens.
        positions = [r.num_computed_tokens for r in decodes]
        input_ids = [r.token_ids[p] for r, p in zip(decodes, positions)]
        slot_mapping = [r.block_ids[p // bs] * bs + p % bs for r, p in zip(decodes, positions)]
        logits_indices = [i for i, r in enumerate(decodes) if positions[i] + 1 == r.num_tokens]
        sampled = [decodes[i] for i in logits_indices]
        prefills = []
        for r, n in chunks:
            start = r.num_computed_tokens
            table = torch.tensor(r.block_ids, dtype=torch.long)
            slots = (table[:, None] * bs + self._block_offsets).flatten()[: start + n]  # (start + n,)
            prefills.append(PrefillChunk(len(input_ids), n, start, slots.to(self.device) if start else None))
            input_ids += r.token_ids[start : start + n]
            positions += range(start, start + n)
            slot_mapping += slots[start:].tolist()
            if start + n == r.num_tokens:  # the chunk reaches the end: its last position is sampled
                logits_indices.append(len(input_ids) - 1)
                sampled.append(r)

        to = dict(device=self.device)
        num_decodes = len(decodes)
        context_lens = torch.tensor(positions[:num_decodes], dtype=torch.int32) + 1
        max_blocks = max((len(r.block_ids) for r in decodes), default=0)
        block_tables = torch.tensor(
            [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in decodes], dtype=torch.int32
        ).view(num_decodes, max_blocks)
        decode_block_ids = decode_mask = None
        if num_decodes and self.model.decode_fn is paged_decode_attention:  # its gather indices, for every layer
            decode_block_ids, decode_mask = decode_gather_indices(block_tables, context_lens, bs, self.dtype)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, **to),
            num_decode_tokens=num_decodes,
            block_tables=block_tables.to(**to),
            context_lens=context_lens.to(**to),
            decode_slots=decode_block_ids,
            decode_mask=decode_mask,
            prefills=tuple(prefills),
            scale=self.model.scale,
        )
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.long, **to),
            positions=torch.tensor(positions, dtype=torch.long, **to),
            meta=meta,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, **to),
            sampled_requests=sampled,
        )

    def run(self, inputs: ModelInput) -> torch.Tensor:  # [S, V] in the model's dtype
        if not inputs.sampled_requests and inputs.input_ids.numel() == 0:
            return torch.empty(0, self.shape.vocab_size, dtype=self.dtype)
        return self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, inputs.logits_indices)
