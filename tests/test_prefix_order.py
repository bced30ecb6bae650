"""The prefix-aware admission order (`engine.prefix_order`), in plain Python: exact orders."""

from __future__ import annotations

import pytest

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.params import SamplingParams
from llmctl.engine.prefix_order import PrefixQueue, prefix_hashes, prefix_order
from llmctl.engine.sequence import Sequence

A, B, C = [1, 1, 2, 2], [3, 3, 4, 4], [5, 5, 6, 6]  # two full blocks each at block size 2


def test_rows_sharing_a_prefix_go_together_groups_in_order_of_their_oldest_row():
    prompts = [A + [10], B + [11], A + [12], C + [13], B + [14], A + [15]]
    assert prefix_order(prompts, 2) == [0, 2, 5, 1, 4, 3]


def test_the_deepest_shared_prefix_comes_next_a_walk_of_the_prefix_tree():
    x = [1, 1]  # the first block, shared by rows 0, 1, 2 and 4 (a common system prompt)
    prompts = [
        x + [2, 2, 9],  # x, y
        x + [3, 3, 9],  # x, z
        x + [2, 2, 8],  # x, y: shares two blocks with row 0, so it follows row 0
        [5, 5, 9],  # nothing shared: waits until the x subtree is done
        x + [3, 3, 7],  # x, z: follows row 1
    ]
    assert prefix_order(prompts, 2) == [0, 2, 1, 4, 3]


def test_prompts_without_a_full_block_keep_input_order():
    assert prefix_order([[7], [8, 1], [7, 1], [9]], 2) == [0, 1, 2, 3]
    assert prefix_order([[1, 2, 3, 4]] * 3, 16) == [0, 1, 2]


def test_the_block_holding_the_last_token_is_no_key_as_the_cache_never_serves_it():
    assert prefix_hashes([1, 1], 2) == ()  # its one block holds the last token
    assert len(prefix_hashes([1, 1, 5], 2)) == 1
    # [1, 1] shares no cacheable block with the others, so it does not join them
    assert prefix_order([[1, 1, 5], [9, 9, 9], [1, 1], [1, 1, 6]], 2) == [0, 3, 1, 2]


def test_keys_are_the_block_hashes_the_prefix_cache_registers():
    ids = list(range(100, 141))  # 2 full blocks of 16 and a partial one
    bm = BlockManager(num_blocks=8, block_size=16)
    seq = Sequence("r", ids, SamplingParams(max_tokens=1), max_len=64)
    assert bm.allocate(seq, len(ids))
    bm.cache_full_blocks(seq, len(ids))
    assert prefix_hashes(ids, 16) == tuple(seq.block_hashes)


def test_the_queue_interleaves_pushes_and_pops_and_returns_the_ids():
    q = PrefixQueue(2)
    q.push(0, A + [10], "a0")
    q.push(1, B + [11], "b1")
    assert q.pop() == (0, A + [10], "a0")
    q.push(2, A + [12], "a2")  # arrives after its group started: still next
    q.push(3, B + [13], "b3")
    assert [q.pop()[0] for _ in range(3)] == [2, 1, 3]
    assert len(q) == 0
    with pytest.raises(IndexError):
        q.pop()


def test_keys_must_arrive_oldest_first_and_once():
    q = PrefixQueue(2)
    q.push(5, A)
    with pytest.raises(ValueError):
        q.push(5, B)
    with pytest.raises(ValueError):
        q.push(4, B)


def test_ids_beyond_64_bits_are_kept_as_given():
    q = PrefixQueue(2)
    q.push(0, [2**70, 1, 2])
    assert q.pop()[1] == [2**70, 1, 2]
