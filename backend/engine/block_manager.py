"""The KV-cache ledger: which physical blocks are free, who references them, and which hold a cached prefix.

Pure Python. The KV pool itself is a tensor owned by the model runner; this module only hands out block ids.
A request's block table is ``request.block_ids`` (logical block ``i`` lives in physical block ``block_ids[i]``).

Prefix caching (as in vLLM): every full block of a request's tokens gets a hash chained with the hash of the
block before it, so equal hashes mean equal prefixes. A full, computed block is registered under its hash; a later
request with the same prefix takes a reference on it instead of recomputing it. Freed blocks keep their hash and
stay hittable until the allocator reuses them, least recently freed first.

Parallel sampling (``n`` > 1, backend/engine/parallel_sampling.py) shares blocks the same way: a forked sequence
takes a reference on each of its parent's blocks (:meth:`fork`). A sequence that is about to write into a block
others still hold gets a block of its own first, and the copy of the shared one's K/V is queued in
``blocks_to_copy`` for the model runner to make before the step's forward (copy on write, :meth:`allocate_slots`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from backend.engine.request import Request


class BlockManager:
    """Hands out fixed-size KV blocks to requests; answers "no room" with ``None``."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer; got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer; got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Free blocks in LRU order: allocation pops from the front, free appends at the back. An OrderedDict
        # (used as an ordered set) lets a prefix-cache hit pull a block out of the middle in O(1).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hashes: list[int | None] = [None] * num_blocks  # the hash a block is cached under, if any
        self.cached_block_ids: dict[int, int] = {}  # hash -> physical block
        # How many leading blocks of each request are already registered, so caching is O(new blocks) per step.
        self._num_cached_blocks: dict[str, int] = {}
        # Copy on write: (shared source, private destination) pairs the runner copies before the next forward.
        self.blocks_to_copy: list[tuple[int, int]] = []

    # ---- capacity -------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # ---- allocation -----------------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> int:
        """Prefix-cache lookup at admission: share the longest cached run of leading full blocks.

        Appends the hit blocks to ``request.block_ids`` (taking a reference on each) and returns the number of
        tokens they cover; the caller sets ``num_computed_tokens`` from it. Returns 0 when caching is off, and for a
        request that needs its prompt's log-probabilities: a cached block holds K/V, not logits, so its prompt runs
        whole (vLLM's rule); its blocks are still cached for others.
        """
        if request.block_ids:
            raise ValueError(f"request {request.request_id!r} already holds blocks; look up the cache first")
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return 0
        self._update_block_hashes(request)
        # NOTE: at least the last token must be computed to produce logits, so never hit the whole sequence.
        max_num_blocks = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        hit_block_ids = []
        for block_hash in request.block_hashes[:max_num_blocks]:
            block_id = self.cached_block_ids.get(block_hash)
            if block_id is None:
                break
            hit_block_ids.append(block_id)
        for block_id in hit_block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_block_ids[block_id]
            self.ref_counts[block_id] += 1
        request.block_ids.extend(hit_block_ids)
        self._num_cached_blocks[request.request_id] = len(hit_block_ids)
        return len(hit_block_ids) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make ``request.block_ids`` cover ``num_computed_tokens + num_new_tokens`` tokens, each block written to
        its own (a block shared with a forked sequence is replaced by a copy: ``blocks_to_copy``).

        All or nothing: returns the newly allocated block ids (often none), or ``None`` without changing anything
        when the free blocks do not suffice.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0; got {num_new_tokens}")
        block_ids = request.block_ids
        num_needed = max(self.num_blocks_for(request.num_computed_tokens + num_new_tokens) - len(block_ids), 0)
        first_written = request.num_computed_tokens // self.block_size
        shared = [i for i in range(first_written, len(block_ids)) if self.ref_counts[block_ids[i]] > 1] \
            if num_new_tokens else []
        if num_needed + len(shared) > len(self.free_block_ids):
            return None
        new_block_ids = []
        for i in shared:
            source, block_ids[i] = block_ids[i], self._pop_free_block()
            self.ref_counts[source] -= 1  # NOTE: never to 0: another sequence still holds it
            self.blocks_to_copy.append((source, block_ids[i]))
            new_block_ids.append(block_ids[i])
        added = [self._pop_free_block() for _ in range(num_needed)]
        block_ids.extend(added)
        return new_block_ids + added

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:  # reusing a cached block evicts its prefix from the cache
            del self.cached_block_ids[block_hash]
            self.block_hashes[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` (a new sequence of ``parent``'s prompt) a reference on each of the parent's blocks."""
        if child.block_ids:
            raise ValueError(f"request {child.request_id!r} already holds blocks; fork only a new sequence")
        for block_id in parent.block_ids:
            self.ref_counts[block_id] += 1
        child.block_ids = list(parent.block_ids)
        num_prompt_blocks = child.num_prompt_tokens // self.block_size  # their hashes are the child's too
        child.block_hashes = parent.block_hashes[:num_prompt_blocks]
        num_cached = self._num_cached_blocks.get(parent.request_id)
        if num_cached is not None:
            self._num_cached_blocks[child.request_id] = min(num_cached, num_prompt_blocks)

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """The copies queued since the last call (the runner makes them before the next forward)."""
        copies, self.blocks_to_copy = self.blocks_to_copy, []
        return copies

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full and computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full_blocks = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks <= num_cached:
            return
        self._update_block_hashes(request)
        for i in range(num_cached, num_full_blocks):
            block_id = request.block_ids[i]
            block_hash = request.block_hashes[i]
            # An identical block may already be cached (computed by another request before this one could hit
            # it): keep that entry; this copy stays unhashed and is reused first-come when freed.
            if self.block_hashes[block_id] is None and block_hash not in self.cached_block_ids:
                self.cached_block_ids[block_hash] = block_id
                self.block_hashes[block_id] = block_hash
        self._num_cached_blocks[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Drop the request's references. Freed blocks keep their hash, so they stay hittable until reused."""
        # Reverse order: tail blocks reach the free queue first and are evicted first, keeping shared prefixes.
        for block_id in reversed(request.block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids[block_id] = None
        if self.blocks_to_copy:  # a copy into a block freed before the forward is not needed any more
            self.blocks_to_copy = [(s, d) for s, d in self.blocks_to_copy if self.ref_counts[d]]
        request.block_ids.clear()
        self._num_cached_blocks.pop(request.request_id, None)

    def _update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to every full block of ``token_ids``; earlier hashes never change."""
        hashes = request.block_hashes
        size = self.block_size
        parent = hashes[-1] if hashes else None
        for start in range(len(hashes) * size, request.num_tokens - size + 1, size):
            parent = hash((parent, tuple(request.token_ids[start : start + size])))
            hashes.append(parent)

    # ---- test support ---------------------------------------------------------------------------------------

    def check_invariants(self, requests: Iterable[Request]) -> None:
        """Raise ``AssertionError`` unless every block is either free or referenced exactly by its owners."""
        owners = [0] * self.num_blocks
        for request in requests:
            if len(set(request.block_ids)) != len(request.block_ids):
                raise AssertionError(f"{request!r} owns a block twice: {request.block_ids}")
            for block_id in request.block_ids:
                owners[block_id] += 1
        if len(self.free_block_ids) != len(set(self.free_block_ids)):
            raise AssertionError("a block is in the free queue twice")
        for block_id in range(self.num_blocks):
            ref_count = self.ref_counts[block_id]
            if ref_count != owners[block_id]:
                raise AssertionError(f"block {block_id}: ref_count {ref_count} but {owners[block_id]} owners")
            if (ref_count == 0) != (block_id in self.free_block_ids):
                raise AssertionError(f"block {block_id}: ref_count {ref_count} disagrees with the free queue")
        for block_hash, block_id in self.cached_block_ids.items():
            if self.block_hashes[block_id] != block_hash:
                raise AssertionError(f"cache entry for block {block_id} disagrees with the block's hash")
        if sum(h is not None for h in self.block_hashes) != len(self.cached_block_ids):
            raise AssertionError("a block carries a hash that is not in the cache map")
        for source, destination in self.blocks_to_copy:
            if not self.ref_counts[destination]:
                raise AssertionError(f"a copy of block {source} is queued into free block {destination}")
