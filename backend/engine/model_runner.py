"""Turns the scheduler's output into tensors, runs the model over the paged KV cache, and returns logits.

The runner owns the device-side state: the weights, the KV pool (one K and one V tensor per layer) and the attention
backend for the device (``backend.engine.attention``), whose metadata it builds once per step.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from backend.engine.attention import AttentionMetadata, PrefillChunk, select_attention_backend
from backend.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, ModelShape, ResolvedConfig
from backend.engine.model import LlamaModel
from backend.engine.request import Request
from backend.engine.scheduler import ScheduledRequest
from backend.engine.shared_cores import cores_available


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA when torch sees a GPU, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device is {device!r} but no CUDA device is available; use device=auto or device=cpu")
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            raise ValueError(f"device is {device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device(device)


def num_gpu_kv_blocks(
    total_bytes: int,
    gpu_memory_utilization: float,
    weights_bytes: int,
    peak_activation_bytes: int,
    non_torch_bytes: int,
    block_bytes: int,
) -> int:
    """KV blocks that fit in ``gpu_memory_utilization`` of the device once everything else is counted (vLLM's rule).

    ``weights_bytes``: what the loaded model holds; ``peak_activation_bytes``: the peak of a forward at the largest
    step, beyond the weights; ``non_torch_bytes``: device memory outside torch's allocator (the CUDA context, other
    processes).
    """
    budget = int(total_bytes * gpu_memory_utilization) - weights_bytes - peak_activation_bytes - non_torch_bytes
    num_blocks = max(budget, 0) // block_bytes
    if num_blocks < 1:
        mib = 1 << 20
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} of {total_bytes / mib:,.0f} MiB leaves "
            f"{budget / mib:,.0f} MiB for the KV cache after the weights ({weights_bytes / mib:,.0f} MiB), the "
            f"activation peak ({peak_activation_bytes / mib:,.0f} MiB) and memory outside torch "
            f"({non_torch_bytes / mib:,.0f} MiB): not one block of {block_bytes:,} bytes. Raise "
            "gpu_memory_utilization, lower max_num_batched_tokens, or set kv_cache_memory_bytes"
        )
    return num_blocks


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
class PromptRows:
    """Rows of the logits at a prompt's positions ``start .. start + num_positions - 1``, kept for its
    ``prompt_logprobs``: the row at position p is the distribution of prompt token p + 1."""

    request: Request
    start: int
    num_positions: int


@dataclass(frozen=True)
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S + P]: the sampled positions, then the prompt positions of prompt_rows
    sampled_requests: list[Request]  # row i < S of the logits belongs to sampled_requests[i]
    blocks_to_copy: tuple[tuple[int, int], ...] = ()  # (source, destination) KV blocks, copied before the forward
    # The P rows after the sampled ones, in order; empty unless a request of the step asks for prompt_logprobs.
    prompt_rows: tuple[PromptRows, ...] = ()


class ModelRunner:
    def __init__(self, config: ResolvedConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        # Intra-op threads on a CPU (all the cores this process may use, unless the config caps them); a GPU's
        # forward needs no share of the cores.
        self.num_threads = config.num_threads or cores_available() if self.device.type == "cpu" else None
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
            _keep_freed_memory_in_process()
        elif self.device.index is not None:
            torch.cuda.set_device(self.device)  # OpenAI Triton launches on the current device
        self.dtype = getattr(torch, config.dtype)  # config's dtype names are torch's (config._DTYPES)
        self.model = LlamaModel(config, self.dtype, self.device, select_attention_backend(self.device))
        self.block_size = config.block_size
        self._block_offsets = torch.arange(self.block_size)
        self.num_kv_blocks = self._num_kv_blocks()
        self.kv_caches = self._allocate_kv_caches(self.num_kv_blocks)

    @property
    def shape(self) -> ModelShape:
        return self.config.model_shape

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        s = self.shape
        cache_shape = (num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        return [
            (torch.zeros(cache_shape, dtype=self.dtype, device=self.device),
             torch.zeros(cache_shape, dtype=self.dtype, device=self.device))
            for _ in range(s.num_layers)
        ]

    def use_threads(self, num_threads: int) -> None:
        """Run the next forwards on ``num_threads`` (its share of the cores). Call it on the thread that steps the
        engine: OpenMP keeps the thread count per thread."""
        if num_threads != torch.get_num_threads():
            torch.set_num_threads(num_threads)

    def _num_kv_blocks(self) -> int:
        c, block_bytes = self.config, self.config.block_bytes
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if c.kv_cache_memory_bytes is None and self.device.type == "cuda":
            return self._profile_gpu_kv_blocks(block_bytes)
        budget = c.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(f"the KV-cache budget ({budget} bytes) holds no block of {block_bytes} bytes")
        return num_blocks

    def _profile_gpu_kv_blocks(self, block_bytes: int) -> int:
        """Size the pool from what is left after the weights and the activation peak of the largest step."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        weights_bytes = torch.cuda.memory_allocated(self.device)
        scratch_bytes = self.profile_run()
        torch.cuda.synchronize(self.device)
        peak_activation_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - weights_bytes - scratch_bytes)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch_bytes = max(0, total - free - torch.cuda.memory_reserved(self.device))
        return num_gpu_kv_blocks(
            total, self.config.gpu_memory_utilization, weights_bytes, peak_activation_bytes, non_torch_bytes,
            block_bytes,
        )

    def profile_run(self) -> int:
        """One forward at the largest step the scheduler can make, so that its activation peak shows in the device's
        memory statistics (this also compiles the kernels). Runs on a scratch KV pool just large enough for it and
        returns that pool's size in bytes.

        The step is ``max_num_batched_tokens`` prompt tokens spread over up to ``max_num_seqs`` sequences (no longer
        than ``max_model_len``), each sampled, as vLLM profiles.
        """
        c, bs = self.config, self.block_size
        num_tokens = min(c.max_num_batched_tokens, c.max_num_seqs * c.max_model_len)
        num_seqs = min(c.max_num_seqs, num_tokens)
        lengths = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        requests, num_blocks = [], 0
        for i, n in enumerate(lengths):
            request = Request(f"profile-{i}", [0] * n)
            request.block_ids = list(range(num_blocks, num_blocks + -(-n // bs)))
            num_blocks += len(request.block_ids)
            requests.append(request)
        scratch = self._allocate_kv_caches(num_blocks)
        inputs = self.prepare([ScheduledRequest.of(r, r.num_tokens) for r in requests])
        self.model.forward(inputs.input_ids, inputs.positions, scratch, inputs.meta, inputs.logits_indices)
        return num_blocks * c.block_bytes

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.config.block_bytes

    def prepare(self, scheduled: list[ScheduledRequest], blocks_to_copy: list[tuple[int, int]] = ()) -> ModelInput:
        """Flatten the scheduler's output into one token stream: single-token decodes first, then prefill chunks.
        A request's last position is sampled where the scheduler says it ``samples``. ``blocks_to_copy`` (copy on
        write of blocks shared by forked sequences) is made before the forward. A request that needs its prompt's
        log-probabilities also has its chunk's prompt positions (but the last prompt token's) after the sampled
        ones in ``logits_indices``: no other request costs the LM head a row more."""
        bs = self.block_size
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        chunks = [s for s in scheduled if s.num_new_tokens > 1]
        # Single tokens (decodes, and one-token prompt chunks) at position num_computed_tokens.
        positions = [s.request.num_computed_tokens for s in decodes]
        input_ids = [s.request.token_ids[p] for s, p in zip(decodes, positions)]
        slot_mapping = [s.request.block_ids[p // bs] * bs + p % bs for s, p in zip(decodes, positions)]
        logits_indices = [i for i, s in enumerate(decodes) if s.samples]
        sampled = [decodes[i].request for i in logits_indices]
        prefills = []
        for s in chunks:
            r, n, start = s.request, s.num_new_tokens, s.request.num_computed_tokens
            table = torch.tensor(r.block_ids, dtype=torch.long)
            slots = (table[:, None] * bs + self._block_offsets).flatten()[: start + n]  # (start + n,)
            prefills.append(PrefillChunk(len(input_ids), n, start, slots.to(self.device) if start else None,
                                         tuple(r.block_ids)))
            input_ids += r.token_ids[start : start + n]
            positions += range(start, start + n)
            slot_mapping += slots[start:].tolist()
            if s.samples:  # the chunk reaches the end: its last position is sampled
                logits_indices.append(len(input_ids) - 1)
                sampled.append(r)
        num_decodes = len(decodes)
        prompt_indices, prompt_rows = [], []
        firsts = [*range(num_decodes), *(p.token_start for p in prefills)]  # each one's first index in the stream
        for s, first in zip(decodes + chunks, firsts):
            r = s.request
            if not r.needs_prompt_logprobs:  # NOTE: the common case, every step: nothing more is computed for it
                continue
            start = r.num_computed_tokens
            num_positions = min(start + s.num_new_tokens, r.num_prompt_tokens - 1) - start  # the last predicts none
            if num_positions > 0:
                prompt_indices += range(first, first + num_positions)
                prompt_rows.append(PromptRows(r, start, num_positions))

        to = dict(device=self.device)
        common = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, **to),
            num_decode_tokens=num_decodes,
            block_tables=_padded_block_tables([s.request.block_ids for s in decodes]).to(**to),  # (B, max_blocks)
            context_lens=(torch.tensor(positions[:num_decodes], dtype=torch.int32) + 1).to(**to),  # (B,)
            prefills=tuple(prefills),
            block_size=bs,
            scale=self.model.scale,
        )
        meta = self.model.attention.build_metadata(common)
        return ModelInput(
            input_ids=torch.tensor(input_ids, dtype=torch.long, **to),
            positions=torch.tensor(positions, dtype=torch.long, **to),
            meta=meta,
            logits_indices=torch.tensor(logits_indices + prompt_indices, dtype=torch.long, **to),
            sampled_requests=sampled,
            blocks_to_copy=tuple(blocks_to_copy),
            prompt_rows=tuple(prompt_rows),
        )

    def run(self, inputs: ModelInput) -> torch.Tensor:  # [S + P, V] in the model's dtype (P: prompt_rows' rows)
        if inputs.blocks_to_copy:
            self.copy_blocks(inputs.blocks_to_copy)
        if not inputs.sampled_requests and inputs.input_ids.numel() == 0:
            return torch.empty(0, self.shape.vocab_size, dtype=self.dtype)
        return self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                                  inputs.logits_indices)


    def copy_blocks(self, pairs: tuple[tuple[int, int], ...]) -> None:
        """Copy each source block's K and V into its destination block, in every layer (copy on write)."""
        sources = torch.tensor([source for source, _ in pairs], dtype=torch.long, device=self.device)  # (C,)
        destinations = torch.tensor([dest for _, dest in pairs], dtype=torch.long, device=self.device)  # (C,)
        for k_cache, v_cache in self.kv_caches:  # (num_blocks, block_size, kv_heads, head_dim) each
            k_cache[destinations] = k_cache[sources]
            v_cache[destinations] = v_cache[sources]


def _padded_block_tables(block_ids: list[list[int]]) -> torch.Tensor:  # [len(block_ids), max_blocks] int32
    """Block tables as one tensor, padded with block 0 (kernels and masks never read past a context)."""
    width = max(map(len, block_ids), default=0)
    return torch.tensor([b + [0] * (width - len(b)) for b in block_ids], dtype=torch.int32).view(len(block_ids), width)
