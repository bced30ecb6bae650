"""n > 1: forked sequences share their parent's KV blocks (exact block ids and reference counts),
and each completion equals the prompt run alone with its derived seed."""

from __future__ import annotations

import pytest
import torch

from llmctl import LLM, SamplingParams
from llmctl.engine.block_manager import BlockManager
from llmctl.engine.params import derived_seed
from llmctl.engine.scheduler import Scheduler
from llmctl.engine.sequence import Sequence, Status
from llmctl.errors import RequestError
from tests.conftest import make_random_model


def seq(name, n, start=0):
    return Sequence(name, list(range(start, start + n)), SamplingParams(), max_len=1000)


def child_of(parent: Sequence, index: int) -> Sequence:
    c = Sequence(parent.request_id, parent.token_ids, SamplingParams(), max_len=1000)
    c.index = index
    return c


def refs(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(6, 4)
    p = seq("p", 6)
    assert bm.allocate(p, 6)
    p.num_computed_tokens = 6
    bm.cache_full_blocks(p, 6)
    a, b = child_of(p, 1), child_of(p, 2)
    assert bm.fork(p, a) == (1, 2)
    assert bm.fork(p, b) == (1, 3)
    assert (p.block_table, a.block_table, b.block_table) == ([0, 1], [0, 2], [0, 3])
    assert refs(bm) == [3, 1, 1, 1, 0, 0]
    assert a.num_computed_tokens == b.num_computed_tokens == 6
    assert a.block_hashes == p.block_hashes and len(a.block_hashes) == 1
    bm.free(p)
    assert refs(bm) == [2, 0, 1, 1, 0, 0] and list(bm.free_queue) == [4, 5, 1]


def test_fork_at_a_block_boundary_copies_nothing_and_without_a_free_block_recomputes():
    bm = BlockManager(3, 4)
    p = seq("p", 8)
    assert bm.allocate(p, 8)
    p.num_computed_tokens = 8
    c = child_of(p, 1)
    assert bm.fork(p, c) is None
    assert c.block_table == [0, 1] and c.num_computed_tokens == 8 and refs(bm) == [2, 2, 0]
    q = seq("q", 6, start=50)  # takes the last free block with a partial one of its own
    bm2 = BlockManager(2, 4)
    assert bm2.allocate(q, 6)
    q.num_computed_tokens = 6
    d = child_of(q, 1)
    assert bm2.fork(q, d) is None  # no free block: the child recomputes tokens 4, 5
    assert d.block_table == [0] and d.num_computed_tokens == 4 and refs(bm2) == [2, 1]


def test_scheduler_runs_forked_children_on_their_own_blocks():
    s = Scheduler(BlockManager(8, 4), 100, 8)
    p = seq("p", 6)
    s.add(p)
    batch = s.schedule()
    assert [(q.request_id, n) for q, n in zip(batch.seqs, batch.num_new_tokens)] == [("p", 6)]
    p.num_computed_tokens = 6
    children = [child_of(p, 1), child_of(p, 2)]
    assert s.fork(p, children) == [(1, 2), (1, 3)]
    assert all(c.status is Status.RUNNING for c in children) and len(s.running) == 3
    for q in s.running:
        q.token_ids.append(7 + q.index)  # each samples its own first token
    batch = s.schedule()  # three decodes of position 6, into blocks 1, 2 and 3
    assert [(q.index, n) for q, n in zip(batch.seqs, batch.num_new_tokens)] == [
        (0, 1),
        (1, 1),
        (2, 1),
    ]
    for q in s.running:
        q.num_computed_tokens += 1
        q.token_ids.append(9)
    for _ in range(2):  # positions 7 (fills the block) and 8 (a new block each)
        s.schedule()
        for q in s.running:
            q.num_computed_tokens += 1
            q.token_ids.append(9)
    assert [q.block_table for q in s.running] == [[0, 1, 4], [0, 2, 5], [0, 3, 6]]
    s.finish(p, "length")
    assert s.bm.blocks[0].ref_count == 2 and s.bm.blocks[1].ref_count == 0


def test_derived_seeds():
    assert derived_seed(None, 3) is None and derived_seed(7, 0) == 7
    seeds = {derived_seed(7, i) for i in range(1, 50)} | {derived_seed(8, i) for i in range(50)}
    assert len(seeds) == 99 and 7 not in seeds  # distinct, and none is a neighbour row's seed
    assert all(0 <= s < 2**64 for s in seeds)
    SamplingParams(seed=derived_seed(2**64 - 1, 5))  # always a valid seed


def test_n_is_validated():
    for bad in (0, -1, 1.5, True, 10_000):
        with pytest.raises(RequestError):
            SamplingParams(n=bad)
    for bad in (-1, 21, 2.0):
        with pytest.raises(RequestError):
            SamplingParams(logprobs=bad)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("fork"), "qwen2", seed=4)


def prompt(length: int) -> list[int]:
    return torch.randint(
        3, 160, (length,), generator=torch.Generator().manual_seed(length)
    ).tolist()


@pytest.mark.parametrize("length", [9, 16], ids=["partial-block", "block-aligned"])
def test_n_completions_equal_the_prompt_run_with_each_derived_seed(model_dir, length):
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=8, batch_invariant=True)
    kw = dict(max_tokens=10, temperature=1.0, ignore_eos=True, logprobs=1)
    out = llm.generate([prompt(length)], SamplingParams(n=4, seed=123, **kw))[0]
    stats = llm.engine.stats
    assert stats.computed_tokens == length + 4 * 9  # the prompt prefilled once
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert out.output_token_ids == out.outputs[0].token_ids and out.text == out.outputs[0].text
    for i, c in enumerate(out.outputs):
        alone = llm.generate([prompt(length)], SamplingParams(seed=derived_seed(123, i), **kw))[0]
        assert c.token_ids == alone.outputs[0].token_ids
        assert [d.keys() for d in c.logprobs] == [d.keys() for d in alone.outputs[0].logprobs]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds, different draws
    assert llm.engine.block_manager.num_used_blocks == 0


def test_n_with_preemption_and_mixed_requests(model_dir):
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", block_size=4, kv_cache_memory=16 * 1024
    )
    kw = dict(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [prompt(9), prompt(5), prompt(13)]
    outs = llm.generate(
        prompts, [SamplingParams(n=3, **kw), SamplingParams(**kw), SamplingParams(n=2, **kw)]
    )
    assert llm.engine.scheduler.num_preemptions > 0
    single = llm.generate(prompts, SamplingParams(**kw))
    for out, ref, n in zip(outs, single, (3, 1, 2)):
        assert len(out.outputs) == n
        assert all(c.token_ids == ref.output_token_ids for c in out.outputs)  # greedy: all alike
    assert llm.engine.block_manager.num_used_blocks == 0
