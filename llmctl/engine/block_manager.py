"""The paged KV cache's bookkeeping: which fixed-size blocks each sequence owns, and prefix caching.

Owns: block allocation, reference counts, and the prefix cache. A full block is identified by a
hash chained over the previous block's hash (the first block's over the sequence's LoRA
adapter, when it has one) and its own tokens (tokens re-checked on a hit); blocks
are shared by reference count and, once free, evicted least-recently-used. Plain Python, no tensors.
"""

from __future__ import annotations

from collections import OrderedDict

from llmctl.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.parent_hash: object = None  # the previous block's hash, or the sequence's root
        self.token_ids: tuple[int, ...] = ()

    def reset(self) -> None:
        self.hash, self.parent_hash, self.token_ids = None, None, ()


def block_hash(parent_hash: object, tokens: tuple[int, ...]) -> int:
    """`parent_hash`: the previous block's hash; for a first block the sequence's root (None, or
    its LoRA adapter's `cache_root`)."""
    return hash((parent_hash, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the first key is evicted first (least recently freed).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # Of the sequences admitted after a lookup (`count_lookup`): prompt tokens the prefix cache
        # served, and prompt tokens looked up.
        self.prefix_hits = 0
        self.prefix_queries = 0

    def reset(self) -> None:
        """Back to a new manager's state: every block free in id order, nothing cached. Only while
        no sequence holds a block."""
        if self.num_used_blocks:
            raise RuntimeError(f"reset with {self.num_used_blocks} blocks in use")
        for block in self.blocks:
            block.reset()
        self.free_queue = OrderedDict((i, None) for i in range(self.num_blocks))
        self.hash_to_block.clear()
        self.prefix_hits = self.prefix_queries = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of `seq`, always leaving the last token to
        compute. Counted by `count_lookup` once the sequence is admitted: a sequence that waits
        for blocks is looked up again every step, and would count each time."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        limit = (seq.num_tokens - 1) // bs  # a block holding the last token is never a hit
        hits: list[int] = []
        parent = seq.cache_root  # None, or the adapter's: prefixes are keyed by adapter
        for i in range(limit):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            bid = self.hash_to_block.get(h)
            if bid is None:
                break
            block = self.blocks[bid]
            if block.token_ids != tokens or block.parent_hash != parent:
                break  # hash collision: treat as a miss
            hits.append(bid)
            parent = h
        return hits

    def count_lookup(self, num_tokens: int, hit_tokens: int) -> None:
        """One admitted sequence's prefix lookup: `hit_tokens` of its `num_tokens` served."""
        self.prefix_queries += num_tokens
        self.prefix_hits += hit_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Give `seq` (plus the cached prefix blocks `cached`, for a sequence with none yet) slots
        for `num_new_tokens` more tokens. Returns False, changing nothing, when blocks run out."""
        reused_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        have = len(seq.block_table) + len(cached)
        start = seq.num_computed_tokens if not cached else len(cached) * self.block_size
        need = self.blocks_needed(start + num_new_tokens) - have
        if max(need, 0) + reused_free > self.num_free_blocks:
            return False
        for bid in cached:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free_queue[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
            seq.block_hashes.append(block.hash)
        for _ in range(need):
            seq.block_table.append(self._take_free_block())
        return True

    def _take_free_block(self) -> int:
        bid, _ = self.free_queue.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None and self.hash_to_block.get(block.hash) == bid:
            del self.hash_to_block[block.hash]  # evicted from the prefix cache
        block.reset()
        block.ref_count = 1
        return bid

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; the tail blocks go first into the eviction order, so a shared
        prefix outlives the sequence-specific ends."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[bid] = None
        seq.block_table = []
        seq.block_hashes = []

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Give `child` (no blocks yet) the K/V of `parent`'s computed tokens: its full blocks
        shared by reference count, its partly filled last block (which both will write) as a copy
        in a fresh block. Returns (source, destination) for the caller to copy the K/V, or None
        when there is nothing to copy; with no free block the child recomputes that block's
        tokens instead."""
        bs = self.block_size
        computed = parent.num_computed_tokens
        full = computed // bs
        for bid in parent.block_table[:full]:
            self.blocks[bid].ref_count += 1
        child.block_table = parent.block_table[:full]
        child.block_hashes = parent.block_hashes[:full]
        child.num_computed_tokens = full * bs
        if computed == full * bs or not self.free_queue:
            return None
        dst = self._take_free_block()
        child.block_table.append(dst)
        child.num_computed_tokens = computed
        return parent.block_table[full], dst

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks of `seq` that its first `num_tokens` tokens fill in the prefix cache.

        Called when a step is scheduled: the K/V of the whole batch is written before any attention
        reads it, so a request admitted later in the same step may already share these blocks."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = num_tokens // bs
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[i - 1] if i else seq.cache_root
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, tokens)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.parent_hash, block.token_ids = h, parent, tokens
            self.hash_to_block.setdefault(h, block.block_id)
            seq.block_hashes.append(h)
