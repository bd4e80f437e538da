"""One attention step as the model runner lays it out, over a pool of random values with shuffled blocks, shared by
the kernel tests (``test_cpu_kernel.py``, ``test_kernels.py``): reading a position outside a context shows up as an
error."""

from __future__ import annotations

import random

import torch

from backend.engine.attention import AttentionMetadata, PrefillChunk


def rope_step_case(decode_lens, chunks, dtype, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=0,
                   device="cpu"):
    """Decodes (their context lengths, the new token included), then prefill chunks ``(num_cached, num_query)``:
    the QKV projection's output, positions, rope tables, the K and V pools and the step's common metadata."""
    gen = torch.Generator().manual_seed(seed)
    lengths = list(decode_lens) + [c + n for c, n in chunks]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (2 * torch.randn(shape, generator=gen)).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lengths]

    def slots_of(table, n):
        return torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])

    positions, prefills = [n - 1 for n in decode_lens], []
    slot_mapping = [slots_of(t, n)[-1:] for t, n in zip(tables, decode_lens)]
    start = len(decode_lens)
    for table, (cached, n) in zip(tables[len(decode_lens):], chunks):
        slots = slots_of(table, cached + n)
        slot_mapping.append(slots[cached:])
        prefills.append(PrefillChunk(start, n, cached, slots.to(device) if cached else None, tuple(table)))
        positions += range(cached, cached + n)
        start += n
    width = max((len(t) for t in tables[: len(decode_lens)]), default=0)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slot_mapping).long().to(device), num_decode_tokens=len(decode_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables[: len(decode_lens)]],
                                  dtype=torch.int32).view(len(decode_lens), width).to(device),
        context_lens=torch.tensor(decode_lens, dtype=torch.int32).to(device), prefills=tuple(prefills),
        block_size=block_size, scale=head_dim**-0.5,
    )
    qkv = torch.randn(start, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.arange(256)[:, None] * (1e4 ** (-torch.arange(head_dim // 2) / (head_dim // 2)))[None, :]
    half_sin = torch.sin(angles)
    cos = torch.cat([torch.cos(angles)] * 2, dim=-1).to(dtype)
    sin_signed = torch.cat([-half_sin, half_sin], dim=-1).to(dtype)
    on = lambda t: t.to(device)  # noqa: E731
    return on(qkv), on(torch.tensor(positions)), on(cos), on(sin_signed), on(k_cache), on(v_cache), meta
