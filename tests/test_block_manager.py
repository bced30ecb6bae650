"""Block manager in plain Python: exact block ids, reference counts, prefix hits and LRU
eviction."""

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.params import SamplingParams
from llmctl.engine.sequence import Sequence


def seq(name, tokens):
    return Sequence(name, tokens, SamplingParams(), max_len=1000)


def admit(bm, s):
    cached = bm.find_cached_prefix(s)
    assert bm.allocate(s, s.num_tokens - len(cached) * bm.block_size, cached)
    s.num_computed_tokens = len(cached) * bm.block_size
    bm.cache_full_blocks(s, s.num_tokens)
    return cached


def refs(bm):
    return [b.ref_count for b in bm.blocks]


def test_allocation_sharing_and_reference_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", list(range(10)))
    assert admit(bm, a) == []
    assert a.block_table == [0, 1, 2]
    b = seq("b", list(range(8)) + [50, 51, 52])
    assert admit(bm, b) == [0, 1]
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 8
    assert refs(bm)[:4] == [2, 2, 1, 1]
    assert bm.num_free_blocks == 4


def test_last_prompt_token_is_never_a_cache_hit():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, seq("a", list(range(10))))
    exact = seq(
        "c", list(range(8))
    )  # two full blocks, both cached, but the last token must be computed
    assert bm.find_cached_prefix(exact) == [0]


def test_free_orders_eviction_least_recently_used_tail_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq("a", list(range(10))), seq("b", list(range(8)) + [50, 51, 52])
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    assert list(bm.free_queue) == [4, 5, 6, 7, 2]
    bm.free(b)
    assert list(bm.free_queue) == [4, 5, 6, 7, 2, 3, 1, 0]
    assert refs(bm) == [0] * 8
    # Freed blocks keep their hashes: a new request with the same prefix still hits them.
    d = seq("d", list(range(8)) + [99])
    assert admit(bm, d) == [0, 1]
    assert d.block_table == [0, 1, 4]
    assert list(bm.free_queue) == [5, 6, 7, 2, 3]


def test_eviction_drops_hash_and_prefix_misses_afterwards():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)  # free queue: [3, 2, 1, 0]; block 0 holds (1, 2), block 1 holds (3, 4)
    filler = seq("f", [9, 9, 9, 9, 9, 9])  # takes 3, 2, 1: evicts the (3, 4) block
    admit(bm, filler)
    assert filler.block_table == [3, 2, 1]
    again = seq("a2", [1, 2, 3, 4, 5])
    assert bm.find_cached_prefix(again) == [0]


def test_allocate_fails_without_side_effects():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq("a", list(range(9)))
    admit(bm, a)
    b = seq("b", list(range(100, 105)))
    assert not bm.allocate(b, 5)
    assert b.block_table == [] and bm.num_free_blocks == 0


def test_hash_collision_is_a_miss(monkeypatch):
    import llmctl.engine.block_manager as m

    monkeypatch.setattr(m, "block_hash", lambda parent, tokens: 42)  # every block collides
    bm = BlockManager(num_blocks=8, block_size=2)
    admit(bm, seq("a", [1, 2, 3]))
    assert bm.find_cached_prefix(seq("b", [7, 8, 9])) == []  # tokens re-checked
    assert bm.find_cached_prefix(seq("c", [1, 2, 9])) == [0]


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(bm, seq("a", list(range(10))))
    assert bm.find_cached_prefix(seq("b", list(range(10)))) == []


def test_reset_frees_in_id_order_and_forgets_the_cache():
    import pytest

    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", list(range(10)))
    admit(bm, a)
    with pytest.raises(RuntimeError, match="3 blocks in use"):
        bm.reset()
    bm.free(a)
    assert list(bm.free_queue)[:3] != [0, 1, 2]  # freed blocks go to the tail
    bm.reset()
    assert list(bm.free_queue) == list(range(8)) and not bm.hash_to_block
    assert admit(bm, seq("b", list(range(10)))) == []  # no prefix hit left behind
