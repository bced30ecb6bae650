"""The measured sweep: metrics on a fake engine with a virtual clock, and a real tiny sweep writing
JSON, CSV, Markdown and a PNG."""

from __future__ import annotations

import csv
import json
import math
import random

import pytest

from llmctl.cli import main
from llmctl.engine.params import RequestOutput
from llmctl.profiling import sweep
from llmctl.profiling.machine import MachinePeaks


class FakeBlockManager:
    def __init__(self, engine):
        self.engine = engine

    @property
    def num_used_blocks(self) -> int:
        return sum(math.ceil((len(r["prompt"]) + len(r["out"])) / 4) for r in self.engine.active)


class FakeEngine:
    """Prefills every waiting request in one step of `prefill_s`, then decodes one token per request
    per step of `decode_s`, on a virtual clock (so the expected metrics are exact)."""

    def __init__(self, prefill_s=0.5, decode_s=0.01):
        self.prefill_s, self.decode_s = prefill_s, decode_s
        self.clock = 100.0
        self.waiting, self.active = [], []
        self.block_manager = FakeBlockManager(self)
        self.prompts_seen = []

    def add_request(self, request_id, prompt_token_ids, params):
        assert params.ignore_eos and params.temperature == 0.0
        self.prompts_seen.append(list(prompt_token_ids))
        self.waiting.append(
            {
                "id": request_id,
                "prompt": list(prompt_token_ids),
                "out": [],
                "arrival": self.clock,
                "first": None,
                "max": params.max_tokens,
            }
        )

    def has_unfinished_requests(self):
        return bool(self.waiting or self.active)

    def step(self):
        if self.waiting:
            self.clock += self.prefill_s
            for r in self.waiting:
                r["out"].append(1)
                r["first"] = self.clock
            self.active += self.waiting
            self.waiting = []
        else:
            self.clock += self.decode_s
            for r in self.active:
                r["out"].append(1)
        done = [r for r in self.active if len(r["out"]) >= r["max"]]
        self.active = [r for r in self.active if len(r["out"]) < r["max"]]
        return [
            RequestOutput(
                r["id"], r["prompt"], r["out"], "", "length", r["arrival"], r["first"], self.clock
            )
            for r in done
        ]


def test_fake_engine_metrics_are_exact():
    engine = FakeEngine(prefill_s=0.5, decode_s=0.01)
    settings = sweep.SweepSettings(
        points=sweep.grid([1, 4], [6], [11]), repeat=3, warmup=1, vocab_size=50
    )
    facts = sweep.ModelFacts(
        weight_bytes=1000, kv_bytes_per_token=10, flops_per_token=lambda ctx: 100.0 + ctx
    )
    peaks = MachinePeaks(
        "k",
        "cpu",
        memory_bandwidth=1e6,
        matmul_flops_bf16=1e5,
        matmul_flops_fp32=4e4,
        measured_at="",
        method={},
    )
    seen = []
    records = sweep.run_sweep(
        engine, settings, facts, peaks, progress=lambda i, n, p: seen.append(i)
    )
    assert seen == [0, 1, 2]
    assert len(engine.prompts_seen) == (1 + 4) * (3 + 1)  # warm-up repeats run but are not recorded
    assert all(len(p) == 6 and all(0 <= t < 50 for t in p) for p in engine.prompts_seen)
    for rec, b in zip(records, (1, 4)):
        assert rec["batch_size"] == b and rec["repeats"] == 3
        assert rec["output_tokens_min"] == rec["output_tokens_max"] == 11
        assert rec["ttft_s"]["p50"] == pytest.approx(0.5) and rec["ttft_s"]["n"] == 3 * b
        assert rec["tpot_s"]["p99"] == pytest.approx(0.01)  # (e2e - ttft) / (11 - 1)
        assert rec["e2e_s"]["mean"] == pytest.approx(0.6)
        assert rec["decode_tokens_per_s_per_sequence"]["p50"] == pytest.approx(100.0)
        assert rec["decode_tokens_per_s"]["p50"] == pytest.approx(b * 100.0)
        assert rec["prefill_tokens_per_s"]["p50"] == pytest.approx(b * 6 / 0.5)
        assert rec["kv_blocks_used"] == b * math.ceil(
            (6 + 10) / 4
        )  # finished requests free their blocks
        assert rec["peak_memory_bytes"] is None or rec["peak_memory_bytes"] > 0
        step_bytes = 1000 + b * (6 + 11 / 2) * 10
        assert rec["mbu"] == pytest.approx(step_bytes / 0.01 / 1e6)
        flops = b * (6 * (100 + 3) + 11 * (100 + 6 + 5))
        assert rec["mfu"] == pytest.approx(
            flops / rec["wall_s"]["p50"] / 1e5
        )  # bf16 model: the larger peak
    fp32_facts = sweep.ModelFacts(1000, 10, lambda ctx: 100.0 + ctx, dtype="fp32")
    mbu, mfu = sweep.utilization(sweep.SweepPoint(1, 6, 11), records[0], fp32_facts, peaks)
    assert mfu == pytest.approx(records[0]["mfu"] * 1e5 / 4e4)  # a float32 model: float32's peak
    slow_bf16 = MachinePeaks(
        "k", "cpu", 1e6, matmul_flops_bf16=1e3, matmul_flops_fp32=4e4, measured_at="", method={}
    )
    assert sweep.utilization(sweep.SweepPoint(1, 6, 11), records[0], facts, slow_bf16)[
        1
    ] == pytest.approx(mfu)
    # no peaks: no utilisation figures
    rec = sweep.point_record(
        sweep.SweepPoint(1, 6, 11),
        [sweep.run_repeat(engine, sweep.SweepPoint(1, 6, 11), random.Random(0), 50, "x")],
        (None, "unavailable"),
        facts,
        None,
    )
    assert rec["mbu"] is None and rec["mfu"] is None


def test_percentiles_match_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(1)
    xs = [rng.random() for _ in range(37)]
    for q in (0, 50, 90, 99, 100):
        assert sweep.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert sweep.summarize([]) is None
    assert sweep.summarize([None, 2.0])["p50"] == 2.0


def test_formulas_name_every_metric():
    for metric in sweep.METRICS:
        assert metric in sweep.FORMULAS
    assert "output_tokens - 1" in sweep.FORMULAS["tpot_s"]


@pytest.fixture()
def one_thread():
    """Multi-threaded CPU GEMMs crawl when the test machine's cores are oversubscribed; one thread
    is steady."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def sweep_files(tmp_path_factory):
    """A real sweep on tinyshakespeare-5m (the embedded demo copy of it when ../shared is
    absent)."""
    from tests.conftest import SHARED

    model = SHARED / "models" / "tinyshakespeare-5m"
    out = tmp_path_factory.mktemp("sweep")
    files = {k: out / f"run.{k}" for k in ("json", "csv", "png")}
    args = [
        "profile",
        *([str(model)] if model.is_dir() else []),
        "--batch-sizes",
        "1,2",
        "--prompt-lens",
        "8",
        "--gen-lens",
        "4",
        "--repeat",
        "2",
        "--warmup",
        "0",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--report-json",
        str(files["json"]),
        "--csv",
        str(files["csv"]),
        "--plot",
        str(files["png"]),
        "--markdown",
        "-q",
    ]
    return args, files


def test_real_sweep_writes_json_csv_markdown_png(sweep_files, capsys, one_thread):
    pytest.importorskip("matplotlib")
    args, files = sweep_files
    assert main(args) == 0
    markdown = capsys.readouterr().out
    assert "| batch | prompt | gen | TTFT p50 (ms)" in markdown and markdown.count("\n| ") >= 3
    record = json.loads(files["json"].read_text())
    assert (
        record["schema"] == sweep.SWEEP_SCHEMA
        and record["schema_version"] == sweep.SWEEP_SCHEMA_VERSION
    )
    env = record["environment"]
    for key in (
        "llmctl_version",
        "torch_version",
        "device",
        "cpu_model",
        "cpu_threads",
        "dtype",
        "date",
    ):
        assert env[key] not in (None, ""), key
    assert env["cpu_threads"] == 1
    assert env["dtype"] == "float32" and env["device"] == "cpu"
    assert set(sweep.METRICS) <= set(record["formulas"])
    assert [(p["batch_size"], p["prompt_len"], p["gen_len"]) for p in record["points"]] == [
        (1, 8, 4),
        (2, 8, 4),
    ]
    for p in record["points"]:
        assert p["output_tokens_min"] == p["output_tokens_max"] == 4  # ignore_eos: exact lengths
        assert 0 < p["ttft_s"]["p50"] <= p["e2e_s"]["p50"]
        assert p["tpot_s"]["p50"] > 0 and p["decode_tokens_per_s"]["p50"] > 0
        assert p["ttft_s"]["p50"] <= p["ttft_s"]["p90"] <= p["ttft_s"]["p99"]
        assert p["kv_blocks_used"] == p["batch_size"]  # 8 + 4 tokens fit one 16-token block each
        assert p["peak_memory_bytes"] > 10 * 2**20
    rows = list(csv.DictReader(files["csv"].open()))
    assert len(rows) == 2 and rows[1]["batch_size"] == "2" and float(rows[0]["ttft_s_p50"]) > 0
    assert rows[0]["torch_version"] == env["torch_version"]
    png = files["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_sweep_rejects_bad_lists_and_too_long(capsys):
    assert main(["profile", "--batch-sizes", "1,x", "-q"]) == 2
    assert main(["profile", "--prompt-lens", "0", "-q"]) == 2
    assert (
        main(["profile", "--prompt-lens", "100000", "--batch-sizes", "1", "--gen-lens", "1", "-q"])
        == 2
    )
    assert "exceeds the model's context" in capsys.readouterr().err
    assert main(["profile", "a", "b"]) == 2


def test_one_token_outputs_have_no_tpot_and_still_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from llmctl.profiling import report

    engine = FakeEngine()
    settings = sweep.SweepSettings(
        points=sweep.grid([1, 2], [4], [1, 5]), repeat=1, warmup=0, vocab_size=9
    )
    points = sweep.run_sweep(engine, settings)
    one = [p for p in points if p["gen_len"] == 1]
    assert all(
        p["tpot_s"] is None and p["decode_tokens_per_s"] is None and p["ttft_s"]["p50"] > 0
        for p in one
    )
    env = {"device": "cpu", "cpu_model": "fake", "cpu_threads": 1, "dtype": "float32"}
    record = report.sweep_record("fake", env, {}, {"repeat": 1}, None, points)
    report.plot(record, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    report.write_csv(record, tmp_path / "p.csv")
    assert (tmp_path / "p.csv").read_text().count("\n") == 5


def test_plot_without_matplotlib_is_one_line_before_the_sweep(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    assert main(["profile", "--plot", "x.png", "-q"]) == 2
    assert "pip install 'llmctl[plot]'" in capsys.readouterr().err
