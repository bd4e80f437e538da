"""What every attention backend shares: the step's metadata as the model runner builds it, and the interface.

The KV pool of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence's
token at position ``p`` lives in physical block ``block_table[p // block_size]``, offset ``p % block_size``; its
flat *slot* is ``block * block_size + offset``.

A step's tokens arrive flattened into one stream ``[T, ...]`` ordered as: decode tokens (one query per sequence)
first, then each prefill chunk. A chunk attends to its cached prefix plus itself, causally.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import ClassVar, TypeVar

import torch


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's chunk of ``num_query_tokens`` tokens in this step."""

    token_start: int  # index of the chunk's first token in the step's token stream
    num_query_tokens: int
    num_cached_tokens: int  # tokens of this sequence already in the cache before this step
    context_slots: torch.Tensor | None  # [num_cached + num_query] slots to gather, None when nothing is cached
    block_ids: tuple[int, ...]  # the sequence's block table (covers the chunk's context)


@dataclass(frozen=True)
class AttentionMetadata:
    """What attention needs about one step, whatever the backend: built once per step by the model runner, extended
    by the backend (:meth:`AttentionBackend.build_metadata`), passed to every layer."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    num_decode_tokens: int  # the first num_decode_tokens of the stream are single-token decodes
    block_tables: torch.Tensor  # [num_decodes, max_blocks] int32, padded with 0 (masked by context_lens)
    context_lens: torch.Tensor  # [num_decodes] int32: tokens each decode attends to (its own included)
    prefills: tuple[PrefillChunk, ...]
    block_size: int
    scale: float

    @property
    def is_decode_only(self) -> bool:
        return not self.prefills

    def extend(self, cls: type[Metadata], **extra) -> Metadata:
        """This metadata as a backend's subclass of it, with that backend's ``extra`` fields."""
        return cls(**{f.name: getattr(self, f.name) for f in fields(AttentionMetadata)}, **extra)


Metadata = TypeVar("Metadata", bound=AttentionMetadata)


class AttentionBackend(ABC):
    """One layer's attention for a whole step, from the layer's QKV projection: the rotary embedding on q and k, the
    new K/V written to the pool, then every token's attention. The device decides which backend runs
    (:func:`backend.engine.attention.select_attention_backend`); they give the same result up to float rounding."""

    name: ClassVar[str]

    def build_metadata(self, common: AttentionMetadata) -> AttentionMetadata:
        """The step's metadata as this backend reads it (built once per step, read by every layer)."""
        return common

    @abstractmethod
    def forward(
        self,
        qkv: torch.Tensor,  # [T, (num_heads + 2 num_kv_heads) head_dim], the QKV projection's output
        positions: torch.Tensor,  # [T] int64
        cos: torch.Tensor,  # [max_len, head_dim] the whole table
        sin_signed: torch.Tensor,  # [max_len, head_dim]: [-sin_lo, sin_hi]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,  # from build_metadata
        num_heads: int,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """One layer's attention output; the step's K/V are in the pool afterwards."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
