"""`profile advise`'s prefix-aware admission trial: when it applies, the order it measures (the one
run-batch --reorder prefix admits in) and the run-batch words it advises."""

from __future__ import annotations

from types import SimpleNamespace

from llmctl.engine.config import EngineConfig
from llmctl.profiling import advise_report as rep
from llmctl.profiling import advise_trials as t
from llmctl.profiling.advise import Measurement, Workload

DOC_A, DOC_B = list(range(100, 140)), list(range(200, 240))  # 2.5 blocks of 16 each


def interleaved() -> Workload:
    prompts = [(DOC_A if i % 2 == 0 else DOC_B) + [i] for i in range(6)]
    return Workload(prompts, [4, 5, 6, 7, 8, 9], 6, 0)


def reorder_trial() -> t.Trial:
    trials = {tr.key: tr for tr in t.candidate_trials(None, None, "float32", None)}
    trial = trials["reorder_prefix"]
    assert trial.reorder and trial.group == "prefix"
    assert trial.engine == {"enable_prefix_caching": True}
    return trial


def test_the_trial_is_skipped_where_grouping_changes_nothing():
    trial = reorder_trial()
    assert t.skip_reason(trial, interleaved(), 6) is None
    in_order = Workload(sorted(interleaved().prompts), [4] * 6, 6, 0)
    assert "prefix order already" in t.skip_reason(trial, in_order, 6)
    unshared = Workload([[i] * 40 for i in range(6)], [4] * 6, 6, 0)
    assert "no shared prefixes" in t.skip_reason(trial, unshared, 6)


def test_the_trial_measures_the_sample_in_prefix_order(monkeypatch):
    seen = []
    monkeypatch.setattr(t, "measure", lambda start, work, *a: seen.append(work) or "m")
    rt = SimpleNamespace(dtype="float32", device="cpu")
    ctx = t.TrialContext(rt, interleaved(), 6, EngineConfig(), [], tools=None)
    assert t.run_trial(ctx, reorder_trial()).measurement == "m"
    assert t.run_trial(ctx, t.Trial("prefix_caching", "p", "prefix")).measurement == "m"
    grouped, plain = seen
    assert [p[-1] for p in grouped.prompts] == [0, 2, 4, 1, 3, 5]
    assert grouped.max_tokens == [4, 6, 8, 5, 7, 9]  # each row keeps its output length
    assert plain.prompts == interleaved().prompts


def test_the_advised_run_batch_line_asks_for_the_order():
    r = t.TrialResult(reorder_trial(), measurement=None)
    q = t.TrialResult(t.Trial("int8", "int8", "quantization", bits=8), measurement=None)
    combined = t.combine([r, q])
    assert combined.reorder and combined.bits == 8 and combined.engine["enable_prefix_caching"]
    req = SimpleNamespace(max_tokens=8, concurrency=None, dtype="auto", device="auto")
    state = SimpleNamespace(req=req, ctx=SimpleNamespace(concurrency=6))
    words = rep.run_batch_args(state, combined, "w.jsonl", "m")
    assert words[-2:] == ["--reorder", "prefix"] and "--no-prefix-caching" not in words
    assert "--reorder" not in rep.run_batch_args(state, t.combine([q]), "w.jsonl", "m")
    assert t.TrialResult(reorder_trial()).to_dict()["reorder"] == "prefix"


def _result(trial: t.Trial, tps: float) -> t.TrialResult:
    m = Measurement(None, None, tps, None, 1.0)
    return t.TrialResult(trial, m)


def test_grouping_is_advised_only_where_it_beats_plain_prefix_caching_beyond_the_noise():
    base = Measurement(None, None, 100.0, None, 1.0)
    plain = t.Trial("prefix_caching", "prefix caching", "prefix", {"enable_prefix_caching": True})
    for reorder_tps, plain_tps, want in [
        (204.0, 200.0, "prefix_caching"),  # 2% better: within the 5% noise
        (220.0, 200.0, "reorder_prefix"),  # 10% better
        (196.0, 200.0, "prefix_caching"),
    ]:
        for order in (1, -1):  # whichever was measured first
            results = [_result(reorder_trial(), reorder_tps), _result(plain, plain_tps)][::order]
            (chosen,) = t.recommended(results, "throughput", base, 0.05, 0.05)
            assert chosen.trial.key == want, (reorder_tps, order)
