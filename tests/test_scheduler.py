"""Scheduler in plain Python: token budget, chunked prefill, decode-first order, preemption."""

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.params import SamplingParams
from llmctl.engine.scheduler import Scheduler
from llmctl.engine.sequence import Sequence, Status


def make(num_blocks=16, block_size=4, budget=8, max_seqs=8, caching=True):
    return Scheduler(BlockManager(num_blocks, block_size, caching), budget, max_seqs)


def seq(name, n, start=0):
    return Sequence(name, list(range(start, start + n)), SamplingParams(), max_len=1000)


def run_step(s: Scheduler):
    """Apply a schedule as the engine would: tokens computed, one sampled when caught up."""
    batch = s.schedule()
    for q, n in zip(batch.seqs, batch.num_new_tokens):
        q.num_computed_tokens += n
        if q.num_computed_tokens == q.num_tokens:
            q.token_ids.append(7)
    return [(q.request_id, n) for q, n in zip(batch.seqs, batch.num_new_tokens)], batch


def test_chunked_prefill_under_token_budget_keeps_decodes_going():
    s = make(budget=8)
    a, b = seq("a", 3), seq("b", 20, start=100)
    s.add(a)
    s.add(b)
    assert run_step(s)[0] == [("a", 3), ("b", 5)]
    # a now decodes one token a step and is listed first; b's prompt proceeds in chunks.
    assert run_step(s)[0] == [("a", 1), ("b", 7)]
    assert run_step(s)[0] == [("a", 1), ("b", 7)]
    assert run_step(s)[0] == [("a", 1), ("b", 1)]  # b's 20th prompt token: 5 + 7 + 7 + 1
    assert b.num_output_tokens == 1
    assert run_step(s)[0] == [("a", 1), ("b", 1)]  # both decode now
    assert b.num_output_tokens == 2 and a.num_output_tokens == 5


def test_max_num_seqs_limits_admission():
    s = make(budget=100, max_seqs=2)
    for i in range(3):
        s.add(seq(f"r{i}", 2, start=10 * i))
    names = [n for n, _ in run_step(s)[0]]
    assert names == ["r0", "r1"] and len(s.waiting) == 1


def test_preemption_frees_latest_and_requeues_it_first():
    s = make(num_blocks=4, block_size=2, budget=100)
    a, b = seq("a", 3), seq("b", 3, start=50)
    s.add(a)
    s.add(b)
    run_step(s)  # a: blocks [0, 1], b: blocks [2, 3]; each has 4 tokens after sampling
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    run_step(s)  # the 4th tokens fit in the second blocks; each now holds 5 tokens
    order, batch = run_step(s)  # a needs a 3rd block: b (admitted last) is preempted
    assert [q.request_id for q in batch.preempted] == ["b"]
    assert order == [("a", 1)]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert s.waiting[0] is b and s.num_preemptions == 1
    assert a.block_table[:2] == [0, 1] and len(a.block_table) == 3


def test_finish_releases_blocks():
    s = make()
    a = seq("a", 5)
    s.add(a)
    run_step(s)
    free_before = s.bm.num_free_blocks
    s.finish(a, "stop")
    assert a.is_finished and a.finish_reason == "stop"
    assert s.bm.num_free_blocks == free_before + 2 and not s.has_unfinished()


def test_same_step_admission_shares_prefix_blocks():
    s = make(num_blocks=16, block_size=4, budget=100)
    a, b = seq("a", 9), seq("b", 9)  # identical prompts
    s.add(a)
    s.add(b)
    order, _ = run_step(s)
    assert order == [
        ("b", 1),
        ("a", 9),
    ]  # one-token rows first; b reuses a's two full blocks, computes its last token
    assert b.block_table[:2] == a.block_table[:2]
