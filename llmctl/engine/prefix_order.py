"""Prefix-aware admission order: which waiting prompt goes to the engine next, so that prompts
sharing a prefix are admitted one after another while the prefix cache still holds it.

Owns: `PrefixQueue`, a bounded pool of waiting prompts (its holder bounds it) handed out in
prefix order, and `prefix_order`, the same order over a list. A prompt's key is the chain of
prefix-cache block hashes of its full blocks (`block_manager.block_hash`, the hashes a cache hit
matches on), so two prompts group exactly where the cache could share their K/V. Plain Python.

The order is a walk of the prefix tree: the next prompt is the oldest waiting one that shares the
most blocks with the prompt handed out last; when none shares a block, the oldest waiting prompt
starts the next group. Oldest rather than most-shared first: the oldest row is the one the
in-order output waits for, so starting groups from it keeps the writer moving and the reorder
buffer small, while every group still goes to the engine in one piece.
"""

from __future__ import annotations

from array import array
from typing import Any, Sequence

from llmctl.engine.block_manager import block_hash

# Deeper than this, prompts are grouped by their first MAX_KEY_BLOCKS blocks only: bounds the
# key's memory per waiting prompt (a few KiB) on very long prompts.
MAX_KEY_BLOCKS = 256


def prefix_hashes(ids: Sequence[int], block_size: int, max_blocks: int = MAX_KEY_BLOCKS) -> tuple:
    """The chained block hashes of the full blocks a prefix cache could serve for `ids` (the
    block holding the last token is always computed, so it never counts)."""
    n = min((len(ids) - 1) // block_size, max_blocks)
    out, parent = [], None
    for i in range(n):
        parent = block_hash(parent, tuple(ids[i * block_size : (i + 1) * block_size]))
        out.append(parent)
    return tuple(out)


def _compact(ids: Sequence[int]) -> Sequence[int]:
    """Token ids as 8 bytes each while they wait (a list of ints takes ~5x that)."""
    try:
        return array("q", ids)
    except (OverflowError, TypeError):  # not plain 64-bit ints: kept as given
        return ids


class PrefixQueue:
    """Waiting prompts, each with an item for its holder; `pop` hands them out in prefix order.
    `key` orders prompts by age (smaller: older) and must be unique among waiting ones."""

    def __init__(self, block_size: int, max_blocks: int = MAX_KEY_BLOCKS):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size, self.max_blocks = block_size, max_blocks
        # key -> (block hashes, token ids, item), oldest first (keys arrive in age order)
        self._waiting: dict[int, tuple[tuple, Sequence[int], Any]] = {}
        self._by_prefix: dict[int, dict[int, None]] = {}  # block hash -> keys, oldest first
        self._last: tuple = ()  # block hashes of the prompt handed out last

    def __len__(self) -> int:
        return len(self._waiting)

    def push(self, key: int, ids: Sequence[int], item: Any = None) -> None:
        if key in self._waiting:
            raise ValueError(f"key {key} is already waiting")
        if self._waiting and key < next(reversed(self._waiting)):
            raise ValueError("keys must be pushed in increasing order")
        hashes = prefix_hashes(ids, self.block_size, self.max_blocks)
        self._waiting[key] = (hashes, _compact(ids), item)
        for h in hashes:
            self._by_prefix.setdefault(h, {})[key] = None

    def pop(self) -> tuple[int, list[int], Any]:
        """(key, token ids, item) of the next prompt to admit; IndexError when none waits."""
        if not self._waiting:
            raise IndexError("pop from an empty PrefixQueue")
        key = next(iter(self._waiting))  # nothing shared: the oldest starts a group
        for h in reversed(self._last):  # the longest prefix shared with the last one
            sharing = self._by_prefix.get(h)
            if sharing:
                key = next(iter(sharing))
                break
        hashes, ids, item = self._waiting.pop(key)
        for h in hashes:
            sharing = self._by_prefix[h]
            del sharing[key]
            if not sharing:
                del self._by_prefix[h]
        self._last = hashes
        return key, list(ids), item


def prefix_order(prompts: Sequence[Sequence[int]], block_size: int) -> list[int]:
    """The indices of `prompts` in the order a `PrefixQueue` holding them all hands them out."""
    q = PrefixQueue(block_size)
    for i, p in enumerate(prompts):
        q.push(i, p)
    return [q.pop()[0] for _ in range(len(prompts))]
