"""`llmctl profile advise`: skip rules, ranking by objective, --max-kl, --budget, the JSON record,
one-line errors before any work, and an interrupted run keeping its trials (fake trial
measurements on the demo model; one real run end to end)."""

from __future__ import annotations

import json

import pytest

from llmctl.cli import main
from llmctl.errors import UsageError
from llmctl.profiling import advise_confirm
from llmctl.profiling import advise_trials as t
from llmctl.profiling.advise import (
    AdviseRequest,
    Measurement,
    Workload,
    measure,
    parse_duration,
    shared_prefix_tokens,
)


def _workload(tmp_path, n=6, shared=True):
    path = tmp_path / "w.jsonl"
    system = "You are a helpful assistant. " * 12 if shared else ""
    rows = [{"prompt": system + f"Question {i}: item {i * 7919} please"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _m(ttft=0.1, tpot=0.01, tps=100.0, mem=1000, wall=1.0):
    return Measurement(
        ttft_s={"p50": ttft, "mean": ttft},
        tpot_s={"p50": tpot, "mean": tpot},
        output_tokens_per_s=tps,
        peak_memory_bytes=mem,
        wall_s=wall,
    )


# per trial key: (measurement, KL); int4 is the fastest but costs too much KL
FAKE = {
    "baseline": (_m(), None),
    "prefix_caching": (_m(ttft=0.02, tps=120.0), None),
    "ngram": (_m(tpot=0.004, tps=150.0), None),
    "budget_512": (_m(ttft=0.09, tpot=0.009), None),
    "budget_8192": (_m(ttft=0.2), None),
    "int8": (_m(tps=130.0, mem=800, tpot=0.008), 0.001),
    "int4": (_m(tps=300.0, mem=500, tpot=0.003), 0.2),
    "gptq4": (_m(tps=290.0, mem=500, tpot=0.003), 0.01),
    "awq4": (_m(tps=280.0, mem=500, tpot=0.003), 0.02),
    "dtype_bfloat16": (_m(tps=102.0), 0.001),
    "dtype_float32": (_m(tps=102.0), 0.001),
    "kv_half": (_m(tps=99.0, mem=900), None),
    "kv_fp8": (_m(tps=160.0, mem=900), None),  # fast, but its agreement is unknown: not advised
    "combined": (_m(ttft=0.015, tpot=0.002, tps=400.0, mem=500), None),
}


@pytest.fixture
def fake_trials(monkeypatch):
    """Trials return FAKE's numbers instead of driving the engine; the calls are recorded."""
    calls = []

    def run_trial(ctx, trial):
        calls.append(trial.key)
        m, kl = FAKE[trial.key]
        return t.TrialResult(trial, m, kl)

    monkeypatch.setattr(t, "run_trial", run_trial)
    return calls


REAL_CONFIRM = advise_confirm.confirm


@pytest.fixture(autouse=True)
def fake_confirm(monkeypatch):
    """The confirmation's fresh processes are faked (a 1.5x gain) unless a test restores it."""
    calls = []

    def confirm(state, rounds):
        calls.append((t.combine(state.chosen), rounds))
        return advise_confirm.Confirmation(1.5, 0.02, [1.5] * rounds, [1.0], [1.5])

    monkeypatch.setattr(advise_confirm, "confirm", confirm)
    return calls


def _advise(tmp_path, *extra):
    out = tmp_path / "r.json"
    args = ["profile", "advise", "--workload", str(_workload(tmp_path)), "--report-json"]
    rc = main(args + [str(out), "-q", "--device", "cpu", *extra])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_parse_duration_and_shared_prefix():
    assert parse_duration("10m") == 600 and parse_duration("90s") == 90
    assert parse_duration("1h") == 3600 and parse_duration("2.5") == 2.5
    with pytest.raises(UsageError, match="--budget"):
        parse_duration("soon")
    # 40 shared tokens: the second and third prompt reuse 32 (two whole blocks of 16) each
    prompts = [list(range(40)) + [100 + i] * 5 for i in range(3)]
    assert shared_prefix_tokens(prompts, 16) == 64
    assert shared_prefix_tokens([[1, 2, 3], [4, 5, 6]], 1) == 0


def test_trials_that_cannot_pay_are_skipped_with_the_reason():
    unshared = Workload([[i, i + 1, i + 2] * 10 for i in range(8)], [8] * 8, 8, 0)
    trials = {tr.key: tr for tr in t.candidate_trials(None, None, "float32", 1 << 20)}
    assert "draft" not in trials and "gptq4" not in trials and "dtype_bfloat16" in trials
    more = {tr.key for tr in t.candidate_trials("d", "calib.txt", "bfloat16", 1 << 20)}
    assert {"draft", "gptq4", "awq4", "dtype_float32"} <= more
    assert "kv_half" not in {tr.key for tr in t.candidate_trials(None, None, "float32", None)}
    assert trials["kv_half"].engine == {"kv_cache_memory": 1 << 19}
    assert "one request at a time" in t.skip_reason(trials["kv_half"], unshared, 1)
    assert t.skip_reason(trials["kv_half"], unshared, 8) is None
    assert "no shared prefixes" in t.skip_reason(trials["prefix_caching"], unshared, 8)
    assert "batch already large" in t.skip_reason(trials["ngram"], unshared, 8)
    assert t.skip_reason(trials["ngram"], unshared, 1) is None
    assert "already fits" in t.skip_reason(trials["budget_8192"], unshared, 8)
    assert "one request at a time" in t.skip_reason(trials["budget_512"], unshared, 1)
    assert t.skip_reason(trials["int4"], unshared, 8) is None
    assert "the same steps as the default" in t.skip_reason(trials["seqs_half"], unshared, 8)
    assert "fit in 256 sequences" in t.skip_reason(trials["seqs_double"], unshared, 8)
    assert t.skip_reason(trials["seqs_half"], unshared, 129) is None
    assert t.skip_reason(trials["seqs_double"], unshared, 257) is None
    shared = Workload([list(range(64)) + [100 + i] for i in range(4)], [8] * 4, 4, 0)
    assert t.skip_reason(trials["prefix_caching"], shared, 4) is None


def test_gain_is_above_one_when_better_for_every_objective():
    base, better = _m(), _m(ttft=0.05, tpot=0.005, tps=200.0, mem=500)
    for objective in ("throughput", "ttft", "tpot", "memory"):
        assert t.gain(objective, base, better) == pytest.approx(2.0)
        assert t.gain(objective, better, base) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "objective, first", [("ttft", "prefix_caching"), ("throughput", "int4"), ("memory", "int4")]
)
def test_ranked_by_objective_and_max_kl_refuses_int4(tmp_path, fake_trials, objective, first):
    rc, record = _advise(tmp_path, "--objective", objective, "--concurrency", "6")
    assert rc == 0
    measured = [tr for tr in record["trials"] if tr["measurement"]]
    assert measured[0]["key"] == first
    assert "int4" not in record["recommended"]  # KL 0.2 > --max-kl 0.05
    skipped = {tr["key"]: tr["skipped"] for tr in record["trials"] if tr["skipped"]}
    assert "batch already large" in skipped["ngram"]


def test_an_fp8_kv_cache_is_advised_only_where_greedy_tokens_agree(tmp_path, fake_trials):
    from dataclasses import replace

    from llmctl.profiling.advise import agreement

    base = replace(_m(), tokens=[[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    close = replace(_m(tps=160.0), tokens=[[1, 2, 3, 4, 5], [6, 7, 8, 9, 11]])
    far = replace(_m(tps=160.0), tokens=[[1, 2, 3, 4, 0], [6, 7, 8, 0, 0]])
    assert agreement(base, close) == 0.9 and agreement(base, far) == 0.7
    trials = t.candidate_trials(None, None, "bfloat16", None)
    trial = next(tr for tr in trials if tr.key == "kv_fp8")
    assert trial.engine == {"kv_cache_dtype": "fp8"}
    for m, advised in ((close, True), (far, False)):
        r = t.TrialResult(trial, m, agreement=agreement(base, m))
        assert (t.recommended([r], "throughput", base, 0.02, 0.05) == [r]) is advised
    rc, record = _advise(tmp_path, "--objective", "throughput")
    assert rc == 0 and "kv_fp8" in fake_trials and "kv_fp8" not in record["recommended"]


def test_max_kl_raised_lets_int4_in_and_commands_apply_it(tmp_path, fake_trials):
    rc, record = _advise(tmp_path, "--objective", "throughput", "--max-kl", "0.5")
    assert rc == 0 and record["recommended"][0] == "int4"
    assert record["combined"]["bits"] == 4 and fake_trials[-1] == "combined"
    quantize, run_batch = record["commands"]
    assert quantize.startswith("llmctl quantize ") and "--rtn --bits 4" in quantize
    assert run_batch.startswith("llmctl run-batch ") and "-rtn-w4" in run_batch
    assert "--no-prefix-caching" not in run_batch  # prefix caching is recommended


def test_calib_adds_gptq_and_awq_and_the_commands_calibrate(tmp_path, fake_trials):
    calib = tmp_path / "calib.txt"
    calib.write_text("some text to calibrate on")
    rc, record = _advise(tmp_path, "--objective", "throughput", "--calib", str(calib))
    assert rc == 0 and {"gptq4", "awq4"} <= set(fake_trials)
    assert "int4" not in record["recommended"] and "gptq4" in record["recommended"]
    quantize, run_batch = record["commands"]
    assert f"--gptq --bits 4 --calib {calib}" in quantize and "-gptq-w4" in run_batch
    missing = ["--calib", str(tmp_path / "nope.txt")]
    assert main(["profile", "advise", "--workload", str(_workload(tmp_path)), *missing]) == 2


def test_kv_and_dtype_trials_print_their_flags(tmp_path, monkeypatch):
    preempting = _m(mem=400)
    preempting.preemptions = 3
    small = dict(FAKE, kv_half=(preempting, None), int4=(_m(mem=500), 0.2))
    monkeypatch.setattr(t, "run_trial", lambda ctx, trial: t.TrialResult(trial, *small[trial.key]))
    rc, record = _advise(tmp_path, "--objective", "memory")
    assert rc == 0 and record["recommended"][0] == "kv_half"
    half = record["baseline_kv_cache_bytes"] // 2
    assert f"--kv-cache-memory {half}" in record["commands"][-1]
    kv = next(tr for tr in record["trials"] if tr["key"] == "kv_half")
    assert kv["measurement"]["preemptions"] == 3
    from llmctl.profiling import advise_report as rep

    row = rep._row("1", "kv", "memory", _m(), t.TrialResult(t.Trial("k", "k", "kv"), preempting), 1)
    assert row[-1] == "3 preemption(s)"
    fast = dict(FAKE, dtype_bfloat16=(_m(tps=150.0), 0.001), dtype_float32=(_m(tps=150.0), 0.001))
    monkeypatch.setattr(t, "run_trial", lambda ctx, trial: t.TrialResult(trial, *fast[trial.key]))
    rc, record = _advise(tmp_path, "--objective", "throughput", "--concurrency", "6")
    chosen = next(k for k in record["recommended"] if k.startswith("dtype_"))
    assert f"--dtype {chosen[6:]}" in record["commands"][-1]


def test_confirm_runs_the_printed_line_against_the_baselines_alternated(
    tmp_path, monkeypatch, capsys
):
    """The real confirm with a fake `run_line`: the words it runs and the gain's arithmetic."""
    monkeypatch.setattr(advise_confirm, "confirm", REAL_CONFIRM)
    runs = []
    ttft = iter([1.0, 0.5, 1.2, 0.4, 1.0, 0.5])  # base, advised, alternated: 2x, 3x, 2x

    def run_line(words):
        runs.append(words)
        sample = words[1]
        rows = open(sample).read().splitlines()
        assert len(rows) == 6 and "prompt_token_ids" in json.loads(rows[0])
        return {"ttft_s": {"p50": next(ttft)}}, 1000

    import llmctl.commands.profile as cmd

    monkeypatch.setattr(cmd, "run_line", run_line)
    monkeypatch.setattr(t, "run_trial", lambda ctx, trial: t.TrialResult(trial, *FAKE[trial.key]))
    rc, record = _advise(tmp_path, "--objective", "ttft", "--confirm-rounds", "3")
    assert rc == 0 and len(runs) == 6
    assert "--no-prefix-caching" in runs[0] and "--no-prefix-caching" not in runs[1]
    c = record["confirmed"]
    assert c["rounds"] == pytest.approx([2.0, 3.0, 2.0]) and c["gain"] == pytest.approx(2.0)
    assert c["noise"] == pytest.approx(0.5)
    ttft = iter([1.0, 1.1])  # one round, slower: no spread, and not a gain
    rc, record = _advise(tmp_path, "--objective", "ttft", "--confirm-rounds", "1", "--markdown")
    assert record["confirmed"]["noise"] is None and len(runs) == 8
    out = capsys.readouterr().out
    assert "one round: spread unknown" in out and "keep the baseline" in out
    rc, record = _advise(tmp_path, "--objective", "ttft", "--confirm-rounds", "0")
    assert record["confirmed"] is None and len(runs) == 8


def test_max_num_seqs_trials_run_at_high_concurrency_and_print_the_flag(tmp_path, monkeypatch):
    many = dict(FAKE, seqs_half=(_m(tps=90.0), None), seqs_double=(_m(tps=125.0), None))
    monkeypatch.setattr(t, "run_trial", lambda ctx, trial: t.TrialResult(trial, *many[trial.key]))
    out = tmp_path / "r.json"
    args = ["profile", "advise", "--workload", str(_workload(tmp_path, n=300)), "--sample", "300"]
    assert main(args + ["--report-json", str(out), "-q", "--device", "cpu"]) == 0
    record = json.loads(out.read_text())
    measured = {tr["key"] for tr in record["trials"] if tr["measurement"]}
    assert {"seqs_half", "seqs_double"} <= measured
    assert "seqs_double" in record["recommended"] and "seqs_half" not in record["recommended"]
    assert "--max-num-seqs 512" in record["commands"][-1]


def test_a_combination_worse_than_its_best_trial_is_not_advised(tmp_path, monkeypatch):
    worse = dict(FAKE, combined=(_m(tps=110.0), None))
    monkeypatch.setattr(t, "run_trial", lambda ctx, trial: t.TrialResult(trial, *worse[trial.key]))
    rc, record = _advise(tmp_path, "--objective", "throughput", "--max-kl", "0.5")
    assert rc == 0 and record["recommended"] == ["int4"]
    assert "advising it alone" in record["combined_skipped"]
    assert "--no-prefix-caching" in record["commands"][-1]


def test_json_record_shape(tmp_path, fake_trials):
    rc, record = _advise(tmp_path, "--objective", "ttft")
    assert rc == 0
    assert record["schema"] == "llmctl.profile.advise" and record["schema_version"] == 1
    assert record["settings"]["objective"] == "ttft" and record["interrupted"] is False
    w = record["workload"]
    assert w["requests"] == 6 and w["concurrency"] == 6 and 0.5 < w["shared_prefix_share"] < 1
    assert set(record["baseline"]) >= {"ttft_s", "tpot_s", "output_tokens_per_s", "wall_s"}
    fit = record["memory_fit"]
    assert record["noise"] >= 0.02 and fit["max_sequences"] > 0
    assert fit["max_sequences_kv_fp8"] >= 2 * fit["max_sequences"] - 1  # half the KV bytes
    keys = [tr["key"] for tr in record["trials"]]
    dtype = record["environment"]["dtype"]
    every = t.candidate_trials(None, None, dtype, record["baseline_kv_cache_bytes"])
    assert sorted(keys) == sorted(tr.key for tr in every)
    assert record["confirmed"]["gain"] == 1.5 and record["confirm_skipped"] is None


def test_budget_skips_trials_that_would_exceed_it(tmp_path, fake_trials, monkeypatch):
    slow = dict(FAKE, baseline=(_m(wall=100.0), None))
    monkeypatch.setattr(
        t, "run_trial", lambda ctx, trial: t.TrialResult(trial, *slow.get(trial.key))
    )
    rc, record = _advise(tmp_path, "--budget", "60s")
    assert rc == 0
    assert all(tr["measurement"] is None for tr in record["trials"])
    assert any("over the --budget" in (tr["skipped"] or "") for tr in record["trials"])


def test_interrupted_run_keeps_the_trials_measured(tmp_path, fake_trials, monkeypatch, capsys):
    def run_trial(ctx, trial):
        if trial.key == "int8":
            raise KeyboardInterrupt
        return t.TrialResult(trial, *FAKE[trial.key])

    monkeypatch.setattr(t, "run_trial", run_trial)
    rc, record = _advise(tmp_path, "--objective", "ttft")
    assert rc == 130 and record["interrupted"] is True
    measured = {tr["key"] for tr in record["trials"] if tr["measurement"]}
    assert measured == {"prefix_caching", "budget_512"}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workload", "missing.jsonl"], "not found"),
        (["--workload", "EMPTY"], "no servable prompt"),
        (["--workload", "W", "--objective", "speed"], "unknown --objective"),
        (["--workload", "W", "--budget", "later"], "--budget"),
        ([], "needs --workload"),
    ],
)
def test_errors_are_one_line_before_any_work(tmp_path, monkeypatch, capsys, args, message):
    import llmctl.runtime.loader as loader

    monkeypatch.setattr(loader, "load_runtime", lambda *a, **k: pytest.fail("model loaded"))
    (tmp_path / "empty.jsonl").write_text("")
    names = {"EMPTY": str(tmp_path / "empty.jsonl"), "W": str(_workload(tmp_path))}
    assert main(["profile", "advise", *[names.get(a, a) for a in args], "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_real_run_on_the_demo_model(tmp_path, capsys):
    """Every measured trial through the engine (and the int8/int4 KL) on two tiny requests."""
    path = _workload(tmp_path, n=2)
    args = ["profile", "advise", "--workload", str(path), "--max-tokens", "4", "--markdown"]
    assert main(args + ["--concurrency", "1", "--device", "cpu", "-q"]) == 0
    out = capsys.readouterr().out
    assert "| baseline |" in out and "speculative n-gram" in out and "llmctl run-batch" in out
    assert "int4 RTN weights" in out and "skipped: one request at a time" in out


class _FakeEngine:
    """Finishes every request on its next step with this pass's TTFT for it (1 output token/s
    after the first), so `measure`'s combining of passes can be checked exactly."""

    def __init__(self, ttfts):
        self.ttfts, self.queue = ttfts, []
        self.model_config = type("C", (), {"vocab_size": 50})()
        self.scheduler = type("S", (), {"num_preemptions": 0})()

    def add_request(self, request_id, prompt, params):
        self.queue.append((request_id, prompt, params.max_tokens))

    def has_unfinished_requests(self):
        return bool(self.queue)

    def step(self):
        from llmctl.engine.params import RequestOutput

        done, self.queue = self.queue, []
        out = []
        for rid, prompt, n in done:
            ttft = self.ttfts.get(rid, 0.0)
            out.append(RequestOutput(rid, prompt, [1] * n, "", "length", 0.0, ttft, ttft + n - 1))
        return out


def test_measure_keeps_each_requests_best_pass_from_fresh_engines():
    work = Workload([[1, 2, 3], [4, 5, 6]], [4, 4], 2, 0)
    # a loaded machine slows a different request in each pass: the best of each is what counts
    passes = iter([{"advise-0": 0.9, "advise-1": 0.1}, {"advise-0": 0.3, "advise-1": 0.8}])
    engines = []

    def start_engine():
        engines.append(_FakeEngine(next(passes)))
        return engines[-1]

    m = measure(start_engine, work, 2, "cpu", repeats=2)
    assert len(engines) == 2 and m.passes == 2
    assert m.ttft_s["n"] == 2 and m.ttft_s["mean"] == pytest.approx(0.2)
    assert m.tpot_s["mean"] == pytest.approx(1.0)
    with pytest.raises(UsageError, match="--repeat"):
        AdviseRequest(workload="w.jsonl", repeats=0).check()


def test_prime_runs_the_samples_shapes_with_nothing_to_share():
    from llmctl.profiling.advise import PRIME_TOKENS, prime

    work = Workload([[1] * 7, [2] * 3, [3] * 12], [50, 60, 70], 3, 0)
    engine = _FakeEngine({})
    seen, in_flight = [], []
    add = engine.add_request

    def record(rid, prompt, params):
        seen.append((prompt, params.max_tokens))
        add(rid, prompt, params)
        in_flight.append(len(engine.queue))

    engine.add_request = record
    prime(engine, work, concurrency=2)
    assert sorted(len(p) for p, _ in seen) == [3, 7, 12]  # every prompt's length, once
    assert all(n == PRIME_TOKENS for _, n in seen)  # a few tokens, not the workload's outputs
    assert not any(p in work.prompts for p, _ in seen)  # random tokens: no prefix to reuse
    assert max(in_flight) == 2  # at the workload's concurrency
