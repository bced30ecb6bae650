"""Linear kernels chosen by measurement (kernels/cpu/linear/autotune.py): the choice rule with a
fake timer, the time budget with a fake clock, the JSON cache (keyed by CPU and shape and every
linear kernel's source; a corrupt file ignored with a warning), every candidate against F.linear,
and the engine and flags that switch it."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from llmctl.kernels.cpu import features, library
from llmctl.kernels.cpu.linear import autotune, c_kernels


def layer(n: int, k: int, dtype=torch.float32, bias: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return SimpleNamespace(weight=w, bias=b)


class FakeTimer:
    """Seconds per call from a table (candidate, rows) -> s, default 1.0; records what it timed."""

    def __init__(self, table: dict[tuple[str, int], float]):
        self.table, self.calls = table, []

    def __call__(self, key: str, name: str, rows: int, run) -> float:
        self.calls.append((key.split()[0], name, rows))
        return self.table.get((name, rows), 1.0)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(
        "LLMCTL_KERNELS", ""
    )  # conftest turns autotune off for the rest of the suite
    return tmp_path


def test_buckets_and_nearest():
    assert autotune.buckets(2048) == (1, 8, 32, 64, 128, 2048)
    assert autotune.buckets(20) == (1, 8, 20)
    assert autotune.buckets(1) == (1,)
    assert [autotune.nearest(r, (1, 8, 32)) for r in (1, 2, 3, 5, 16, 17, 100)] == [
        1,
        1,
        8,
        8,
        8,
        32,
        32,
    ]


def test_choice_is_the_fastest_per_bucket(cache):
    layers = [layer(24, 16, seed=i) for i in range(3)] + [layer(40, 16)]
    fake = FakeTimer({("native", 1): 0.1, ("torch", 8): 0.2, ("packed", 32): 0.1})
    plans = autotune.tune(layers, [32] * 4, measure=fake)
    assert plans[0] is plans[1] is plans[2] and plans[3] is not plans[0]  # one plan per shape
    assert plans[0].choices == {1: "native", 8: "torch", 32: "packed"}
    by = autotune.BY_NAME
    assert plans[0].kernel(1) is by["native"]
    assert plans[0].kernel(3) is by["torch"]  # nearest bucket: 8
    assert plans[0].kernel(20) is by["packed"] and plans[0].kernel(500) is by["packed"]
    assert plans[0].packs
    assert {c[0] for c in fake.calls} == {"24x16", "40x16"}  # each shape timed once per bucket
    assert len([c for c in fake.calls if c[2] == 1]) == 2 * autotune.ROUNDS * len(
        [c for c in autotune.CANDIDATES if c.applies(layers[0].weight)]
    )


def test_candidates_are_timed_in_turn_so_a_drift_weighs_on_all(cache):
    # a machine slowing down steadily as tuning goes on; torch, timed first, is 10% slower than the
    # others at any moment: timed in one block each, it would win on the drift alone
    seen, now = [], [0.0]

    def drifting(key, name, rows, run):
        seen.append(name)
        now[0] += 1.0
        return now[0] * (1.1 if name == "torch" else 1.0)

    plans = autotune.tune([layer(24, 16)], [1], measure=drifting)
    n = len(seen) // autotune.ROUNDS
    assert seen[0] == "torch" and autotune.ROUNDS == 2 and seen[n:] == seen[:n][::-1]
    assert plans[0].choices[1] != "torch"


def test_packed_copy_needs_a_clear_win():
    assert autotune.choose({"torch": 1.0, "packed": 0.95}) == "torch"
    assert autotune.choose({"torch": 1.0, "packed": 0.8}) == "packed"
    assert autotune.choose({"torch": 1.0, "native": 0.5}) == "native"
    assert autotune.choose({}) is None
    # the shape holds a packed copy for another bucket: its memory is spent, the fastest wins
    assert autotune.choose({"torch": 1.0, "packed": 0.95}, packed_already=True) == "packed"
    assert autotune.choose({"torch": 0.9, "packed": 0.95}, packed_already=True) == "torch"


def test_once_packed_every_bucket_takes_its_fastest(cache):
    # packed: a clear win at 8 rows, a small one (under MEMORY_MARGIN) at 32 and 128, none at 64
    fake = FakeTimer({("packed", 8): 0.5, ("packed", 32): 0.95, ("packed", 128): 0.95})
    plans = autotune.tune([layer(24, 16)], [128], measure=fake)
    assert plans[0].choices[8] == plans[0].choices[32] == plans[0].choices[128] == "packed"
    saved = json.loads(autotune.cache_path().read_text())["entries"]
    assert list(saved.values())[0] == {
        "1": plans[0].choices[1],
        "8": "packed",
        "32": "packed",
        "64": "torch",
        "128": "packed",
    }
    # no bucket with a clear win: no packed copy at all
    fake = FakeTimer({("packed", 8): 0.95, ("packed", 32): 0.95})
    plans = autotune.tune([layer(40, 16)], [32], measure=fake)
    assert not plans[0].packs


def test_large_models_get_no_packed_copies(cache, monkeypatch):
    monkeypatch.setattr(autotune, "PACK_MAX_BYTES", 24 * 16 * 4 - 1)  # below one layer's bytes
    fake = FakeTimer({("packed", 1): 0.01})
    plans = autotune.tune([layer(24, 16)], [1], measure=fake)
    assert "packed" not in {name for _, name, _ in fake.calls} and not plans[0].packs


def test_a_few_rows_kernel_far_behind_is_not_timed_at_larger_buckets(cache):
    if library.load("core") is None:
        pytest.skip("needs the native kernels (a C compiler)")
    fake = FakeTimer({("native", 1): 5.0, ("packed", 1): 5.0})  # 5x the others
    autotune.tune([layer(24, 16)], [128], measure=fake)
    timed = {(name, rows) for _, name, rows in fake.calls}
    assert ("native", 1) in timed and not any(n == "native" and r > 1 for n, r in timed)
    assert ("torch", 128) in timed and ("packed", 128) in timed  # the BLAS ones gain with rows


def test_the_budget_stops_timing_and_leaves_the_static_rule(cache):
    now = [0.0]

    def clock():
        return now[0]

    def measure(key, name, rows, run):
        now[0] += 1.0  # each measurement costs a second
        return 1.0

    n_cand = len([c for c in autotune.CANDIDATES if c.applies(layer(24, 16).weight)])
    plans = autotune.tune(
        [layer(24, 16)],
        [128],
        measure=measure,
        clock=clock,
        budget_s=n_cand * autotune.ROUNDS + 0.5,
    )
    assert sorted(plans[0].choices) == [1]  # bucket 1 complete, bucket 8 cut short
    assert plans[0].kernel(1) is not None and plans[0].kernel(8) is None  # static rule
    assert plans[0].kernel(100) is None
    saved = json.loads(autotune.cache_path().read_text())["entries"]
    assert [list(e) for e in saved.values()] == [["1"]]  # only what was measured is cached


def test_cache_round_trip_keyed_by_cpu_and_shape(cache, monkeypatch):
    layers = [layer(24, 16), layer(40, 16, bias=True)]
    fake = FakeTimer({("native", 8): 0.1})
    first = autotune.tune(layers, [8, 8], measure=fake)
    path = autotune.cache_path()
    assert path.parent == cache / "autotune" and path.suffix == ".json"
    data = json.loads(path.read_text())
    keys = sorted(data["entries"])
    assert keys[0].startswith("24x16 float32 threads=") and keys[1].startswith("40x16 float32 bias")
    assert data["entries"][keys[0]]["8"] == "native"

    def never(*a):
        raise AssertionError("a cached shape was timed again")

    again = autotune.tune(layers, [8, 8], measure=never)
    assert [p.choices for p in again] == [p.choices for p in first]
    monkeypatch.setattr(autotune, "fingerprint", lambda: "flags : another cpu")
    assert autotune.cache_path() != path  # another CPU model: its own file, timed afresh
    fake2 = FakeTimer({})
    autotune.tune(layers, [8, 8], measure=fake2)
    assert fake2.calls


def test_a_corrupt_cache_is_ignored_with_a_warning(cache):
    path = autotune.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    fake = FakeTimer({})
    with pytest.warns(RuntimeWarning, match="unreadable autotune cache"):
        autotune.tune([layer(24, 16)], [8], measure=fake)
    assert fake.calls
    assert json.loads(path.read_text())["version"] == autotune.CACHE_VERSION  # rewritten
    stale = {"version": autotune.CACHE_VERSION, "entries": {"x": {"1": "no-such-kernel"}}}
    path.write_text(json.dumps(stale))
    assert autotune.load_cache(path) == {"x": {}}  # unknown kernels are dropped


def test_real_timer_runs_every_candidate(cache):
    plans = autotune.tune([layer(24, 16, seed=i) for i in range(2)], [8])
    assert set(plans[0].choices) == {1, 8}
    assert set(plans[0].choices.values()) <= set(autotune.BY_NAME)


def _candidates(dtype: torch.dtype, w: torch.Tensor) -> list[autotune.Candidate]:
    return [c for c in autotune.CANDIDATES if c.applies(w)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17, 130])
@pytest.mark.parametrize("n,k", [(13, 24), (70, 40), (130, 72), (5, 33), (64, 96)])
def test_every_candidate_matches_f_linear(dtype, rows, n, k):
    g = torch.Generator().manual_seed(rows * n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    ref = F.linear(x.float(), w.float(), b.float())
    tol = dict(rtol=1e-5, atol=1e-4) if dtype is torch.float32 else dict(rtol=2e-2, atol=5e-2)
    names = []
    with torch.inference_mode():
        for c in _candidates(dtype, w):
            packed = {c.name: c.pack(w)} if c.packs else None
            for bias in (b, None):
                y = c.run(x, w, bias, packed)
                assert y.dtype is dtype and y.shape == (rows, n)
                want = ref if bias is not None else ref - b.float()
                torch.testing.assert_close(y.float(), want, **tol, msg=c.name)
            names.append(c.name)
    assert "torch" in names
    if library.load("core") is not None and k % 8 == 0:
        assert "native" in names
    if dtype is torch.bfloat16:
        assert "upcast" in names
        if c_kernels.dpbf16_library() is not None:
            assert "dpbf16" in names
        if c_kernels.amx_library() is not None and n % 32 == 0 and k % 32 == 0:
            assert "amx" in names


def test_dpbf16_kernel_leading_dims_and_threads():
    if c_kernels.dpbf16_library() is None:
        pytest.skip("no AVX512-BF16 on this CPU (or no C compiler): the kernel is never used here")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(67, 100, generator=g).bfloat16()
    x = torch.randn(2, 5, 100, generator=g).bfloat16()
    ref = F.linear(x.float(), w.float()).bfloat16()
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            y = c_kernels.dpbf16(x, w)
            assert y.shape == (2, 5, 67)
            torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=5e-2)
    finally:
        torch.set_num_threads(threads)
    x_strided = torch.randn(4, 200, generator=g).bfloat16()[:, ::2]  # rows not contiguous
    torch.testing.assert_close(
        c_kernels.dpbf16(x_strided, w).float(),
        F.linear(x_strided.float(), w.float()),
        rtol=1e-2,
        atol=5e-2,
    )


def test_dpbf16_is_never_used_without_the_cpu_flag(monkeypatch):
    monkeypatch.setattr(features, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    features.has_dpbf16.cache_clear()
    c_kernels.dpbf16_library.cache_clear()
    try:
        assert c_kernels.dpbf16_library() is None
        w = torch.randn(8, 16).bfloat16()
        assert not c_kernels.dpbf16_applies(torch.randn(1, 16).bfloat16(), w)
        assert "dpbf16" not in [c.name for c in _candidates(torch.bfloat16, w)]
    finally:
        features.has_dpbf16.cache_clear()
        c_kernels.dpbf16_library.cache_clear()


def test_engine_tunes_at_start_and_no_autotune_keeps_the_static_rules(shakespeare_model, cache):
    from llmctl.engine.params import SamplingParams
    from llmctl.llm import LLM

    prompts = [[int(t) for t in torch.randint(0, 60, (n,))] for n in (3, 40, 17)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tuned = LLM(str(shakespeare_model), dtype="float32", max_num_batched_tokens=64)
    model = tuned.runtime.model
    from llmctl.models.layers import Linear

    # q/k/v and gate/up are served merged (models/merged.py): the merged linears are tuned.
    merged = [b.merged for layer in model.layers for b in (layer.self_attn, layer.mlp)]
    parts = {id(p) for m in merged for p in m.parts}
    plans = {type(m.plan) for m in model.modules() if type(m) is Linear and id(m) not in parts}
    plans |= {type(m.linear.plan) for m in merged}
    assert model.lm_head.plan is not None and model.lm_head.plan.max_rows == 256  # max_num_seqs
    assert model.layers[0].mlp.down_proj.plan.max_rows == 64 and plans == {autotune.Plan}
    assert model.layers[0].mlp.merged.linear.plan.max_rows == 64
    out = [o.output_token_ids for o in tuned.generate(prompts, params)]
    assert autotune.cache_path().exists()
    static = LLM(str(shakespeare_model), dtype="float32", autotune=False)
    assert all(getattr(m, "plan", None) is None for m in static.runtime.model.modules())
    assert [o.output_token_ids for o in static.generate(prompts, params)] == out
    static.runtime.start_engine(tuned.engine.engine_config)  # the same runtime, tuned again
    assert static.runtime.model.lm_head.plan is not None
    invariant = LLM(str(shakespeare_model), dtype="float32", batch_invariant=True)
    assert all(getattr(m, "plan", None) is None for m in invariant.runtime.model.modules())


def test_env_switch_keeps_the_static_rules(shakespeare_model, cache, monkeypatch):
    from llmctl.llm import LLM

    monkeypatch.setenv("LLMCTL_KERNELS", "autotune=0")
    llm = LLM(str(shakespeare_model), dtype="float32")
    assert all(getattr(m, "plan", None) is None for m in llm.runtime.model.modules())
    assert not (cache / "autotune").exists()


def test_no_autotune_flags_reach_the_engine_config(monkeypatch):
    import llmctl.commands.run_batch as rb
    import llmctl.profiling.sweep_job as sj
    from llmctl.cli import main
    from llmctl.engine.config import EngineConfig

    seen = []
    monkeypatch.setattr(rb, "_run", lambda opts, quiet: seen.append(opts))
    assert main(["run-batch", "in.jsonl", "--no-autotune"]) == 0
    assert seen[0].engine == {"autotune": False} and EngineConfig().autotune
    assert main(["run-batch", "in.jsonl"]) == 0 and "autotune" not in seen[1].engine

    def fake_sweep(req, target, load_runtime, progress):
        seen.append(req)
        raise KeyboardInterrupt  # stop before any model is loaded (main answers 130)

    monkeypatch.setattr(sj, "profile_sweep", fake_sweep)
    for argv, want in ((["profile", "--no-autotune"], False), (["profile"], True)):
        assert main(argv) == 130 and seen[-1].autotune is want
    monkeypatch.setattr(sj, "kv_bytes_per_sequence", lambda *a: 1)
    config = sj.sweep_engine_config(SimpleNamespace(), "float32", 1, 8, "1MiB", 0, autotune=False)
    assert config.autotune is False


def test_wall_clock_times_passes_over_distinct_weights():
    """A pass of calls over weights in turn, the fastest pass per call: one slow call (a weight
    out of cache) weighs on its pass instead of being skipped as a single slow call."""
    seen = []

    def run(i):
        seen.append(i)
        time.sleep(0.003 if i == 2 else 0.0005)

    per_call = autotune.wall_clock("k", "c", 1, run)
    assert seen == list(range(len(seen))) and len(seen) == 1 + autotune.PASS_CALLS
    assert per_call >= (0.003 + 3 * 0.0005) / autotune.PASS_CALLS  # the slow call counted


def test_measurements_start_past_the_last_ones_weights():
    """Each measurement's first call reads another weight than the last measurement's calls did
    (those sit in the cache)."""
    layers = [layer(24, 16, seed=i) for i in range(40)]
    read = []

    def record(x, w, b, p):
        read.append(id(w))
        return F.linear(x, w, b)

    alive = [autotune.Candidate(n, record, lambda w: True) for n in ("a", "b")]
    g = autotune._Group("k", 1, list(range(40)), alive, {})
    firsts = []

    def measure(key, name, rows, run):
        run(0)
        firsts.append(read[-1])
        for i in range(1, autotune.MAX_CALLS + 1):
            run(i)
        return 1.0

    times = autotune._time_bucket(g, layers, 1, measure, lambda: False)
    assert set(times) == {"a", "b"}
    assert len(firsts) == 2 * autotune.ROUNDS and len(set(firsts)) == len(firsts)
    measured = read[len(alive) :]  # after each candidate's one checked call (autotune._agrees)
    assert set(firsts).isdisjoint(measured[: autotune.MAX_CALLS + 1][1:])  # not the first's


def test_a_candidate_giving_a_wrong_result_is_never_timed():
    """Checked once against F.linear before timing: a wrong shape (oneDNN's packed bf16 linear
    under an AVX2 cap returned [rows, 0]) or wrong values drop the candidate, however fast."""
    layers = [layer(24, 16, seed=1)]
    right = lambda x, w, b, p: F.linear(x, w, b)  # noqa: E731
    empty = lambda x, w, b, p: x.new_empty(x.shape[0], 0)  # noqa: E731
    off = lambda x, w, b, p: F.linear(x, w, b) * 1.1  # noqa: E731
    cands = [("right", right), ("empty", empty), ("off", off)]
    alive = [autotune.Candidate(n, fn, lambda w: True) for n, fn in cands]
    g = autotune._Group("k", 1, [0], alive, {})
    times = autotune._time_bucket(g, layers, 4, lambda key, name, rows, run: 1.0, lambda: False)
    assert set(times) == {"right"}


def _included(source) -> set:
    """The headers a C file includes with quotes, and theirs in turn."""
    found, todo = set(), [source]
    while todo:
        for line in todo.pop().read_text().splitlines():
            if line.startswith('#include "'):
                header = source.parent / line.split('"')[1]
                if header not in found:
                    found.add(header)
                    todo.append(header)
    return found


def test_the_cache_key_hashes_every_source_of_every_linear_kernel(monkeypatch, tmp_path):
    """Editing any C file a linear kernel is compiled from (or a header it includes) changes the
    shape key, so stale timings are never reused (the key once hashed the decode-attention source
    instead of cpu_linear.c, and never cpu_linear_amx.c)."""
    # cpu_linear_int8.c: W8A8's quantize/rescale passes, timed per process (kernels/cpu/linear/
    # int8.py), never from the autotuner's cache
    linear_c = sorted(
        p for p in library.CSRC.glob("cpu_linear*.c") if p.name != "cpu_linear_int8.c"
    )
    assert {p.name for p in linear_c} == {"cpu_linear.c", "cpu_linear_dpbf16.c", "cpu_linear_amx.c"}
    for name in ("linear_dpbf16", "linear_amx"):
        assert set(library.sources(name)) <= set(c_kernels.SOURCES)
    assert library.CSRC / "cpu_linear.c" in c_kernels.SOURCES  # built inside the "core" library
    for source in linear_c:
        assert _included(source) <= set(c_kernels.SOURCES), source.name
    before = autotune.shape_key(64, 32, torch.bfloat16, False)
    for i, source in enumerate(c_kernels.SOURCES):
        edited = tmp_path / f"{i}-{source.name}"
        edited.write_text(source.read_text() + "\n/* edited */\n")
        copies = tuple(edited if s == source else s for s in c_kernels.SOURCES)
        monkeypatch.setattr(autotune, "SOURCES", copies)
        assert autotune.shape_key(64, 32, torch.bfloat16, False) != before, source.name
    monkeypatch.setattr(autotune, "SOURCES", c_kernels.SOURCES)
    assert autotune.shape_key(64, 32, torch.bfloat16, False) == before


def test_choices_made_without_the_c_kernels_do_not_stand_in_for_them(cache):
    """A tune with KernelConfig(native=False) is cached apart: a later tune with the C kernels
    times them rather than reusing choices they were never candidates for."""
    if library.load("core") is None:
        pytest.skip("needs the native kernels (a C compiler)")
    fake = FakeTimer({("native", 1): 0.01, ("native", 8): 0.01})
    assert autotune.tune([layer(24, 16)], [8], measure=fake, native=False)[0].choices == {
        1: "torch",
        8: "torch",
    }
    fake = FakeTimer({("native", 1): 0.01, ("native", 8): 0.01})
    again = autotune.tune([layer(24, 16)], [8], measure=fake)
    assert again[0].choices == {1: "native", 8: "native"} and fake.calls
