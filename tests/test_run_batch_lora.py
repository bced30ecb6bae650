"""`llmctl run-batch --lora-modules` end to end on the tinyshakespeare fixture: two PEFT adapters
with random non-zero weights on different projections, served in one job mixed with base rows
(simple rows by `model` or `lora`, OpenAI rows by body.model), each row's tokens equal to
transformers + PEFT merged in float32; over a shared prefix with the prefix cache on and a KV
cache small enough to preempt; `unknown_model` rows; resume refuses a changed adapter; the
flags' errors."""

from __future__ import annotations

import json

import pytest

from llmctl.cli import main
from tests.lora_helpers import adapters, merged_greedy  # noqa: F401 (a fixture)

MAX_NEW = 8
TEXTS = [
    "ROMEO:\nI will not be",
    "KING RICHARD III:\nNow is the winter of our discontent",
    "KING RICHARD III:\nNow is the winter of our discontent made glorious",
]
BASE = "tinyshakespeare-5m"  # the fixture folder's name: a row's model naming the base


@pytest.fixture(scope="module")
def refs(shakespeare_model, adapters):  # noqa: F811
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(shakespeare_model))
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    out = {None: merged_greedy(shakespeare_model, None, prompts, MAX_NEW)}
    for name, folder in adapters.items():
        out[name] = merged_greedy(shakespeare_model, folder, prompts, MAX_NEW)
    return out


def _argv(model, adapters, inp, out, *extra):  # noqa: F811
    mods = [a for n, f in adapters.items() for a in ("--lora-modules", f"{n}={f}")]
    return [
        "run-batch", str(inp), "-o", str(out), "-q", "--model", str(model), "--dtype", "float32",
        "--device", "cpu", "--max-tokens", str(MAX_NEW), "--ignore-eos", "--include-token-ids",
        "--enable-lora", *mods, *extra,
    ]  # fmt: skip


def _simple_rows():
    """(row, adapter expected) per row: every text under the base and both adapters, named in
    each way a row may name them, interleaved."""
    rows = []
    for i, text in enumerate(TEXTS):
        rows += [
            ({"prompt": text}, None),
            ({"prompt": text, "lora": "attn"}, "attn"),
            ({"prompt": text, "model": "mlp"}, "mlp"),
            ({"prompt": text, "model": BASE}, None),
            ({"prompt": text, "model": "attn"}, "attn"),
        ]
    return rows


@pytest.mark.parametrize(
    "extra",
    [
        ["--block-size", "4"],  # the shared prefix's blocks cached under each adapter apart
        ["--block-size", "4", "--kv-cache-memory", str(12 * 4 * 3072), "--max-num-seqs", "8"],
        ["--max-loras", "1"],  # the adapters take turns in one slot
    ],
    ids=["prefix-cache", "preemption", "one-slot"],
)
def test_mixed_job_matches_merged_peft(
    shakespeare_model,
    adapters,  # noqa: F811
    refs,
    tmp_path,
    extra,
    monkeypatch,
):
    from llmctl.engine.scheduler import Scheduler

    preempted = []
    original = Scheduler._preempt
    monkeypatch.setattr(
        Scheduler, "_preempt", lambda self, seq: (preempted.append(seq.lora), original(self, seq))
    )
    rows = _simple_rows() + [({"prompt": TEXTS[0], "model": "nope"}, "error")]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r, _ in rows))
    report = tmp_path / "report.json"
    argv = _argv(shakespeare_model, adapters, inp, out, *extra, "--report-json", str(report))
    assert main(argv) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    for (row, name), rec in zip(rows, got):
        if name == "error":
            assert rec["error"]["code"] == "unknown_model" and "'nope'" in rec["error"]["message"]
            continue
        assert rec["error"] is None
        assert rec["token_ids"] == refs[name][TEXTS.index(row["prompt"])], (row, name)
    summary = json.loads(report.read_text())
    assert summary["prefix_cache"]["hit_tokens"] > 0  # rows of one adapter shared the prefix
    if "--kv-cache-memory" in extra:  # adapter rows among those preempted and recomputed
        assert any(a is not None for a in preempted), preempted


def test_openai_rows_pick_adapters_by_model(shakespeare_model, adapters, refs, tmp_path):  # noqa: F811
    names = [None, "attn", "mlp", BASE, "gpt-4o"]
    lines = []
    for i, name in enumerate(names):
        body = {"prompt": TEXTS[1], **({"model": name} if name else {})}
        lines.append({"custom_id": f"r{i}", "url": "/v1/completions", "body": body})
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(_argv(shakespeare_model, adapters, inp, out)) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    for name, rec in zip(names, got):
        body = rec["response"]["body"]
        if name == "gpt-4o":
            assert body["error"]["code"] == "unknown_model"
            continue
        adapter = name if name in adapters else None
        assert body["choices"][0]["token_ids"] == refs[adapter][1]
        assert body["model"] == (adapter or str(shakespeare_model))  # as served


def test_resume_refuses_a_changed_adapter(shakespeare_model, adapters, tmp_path, capsys):  # noqa: F811
    from tests.lora_helpers import ADAPTERS, make_adapter

    mine = {
        n: make_adapter(shakespeare_model, tmp_path / n, k, **ADAPTERS[n])
        for k, n in enumerate(adapters)
    }
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"prompt": TEXTS[0], "lora": "attn"}) + "\n")
    assert main(_argv(shakespeare_model, mine, inp, out)) == 0
    capsys.readouterr()
    make_adapter(
        shakespeare_model, mine["attn"], 7, **ADAPTERS["attn"]
    )  # the same name, new weights
    assert main(_argv(shakespeare_model, mine, inp, out)) == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "lora_modules" in err, err


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--lora-modules", "x"], "--lora-modules 'x': give NAME=PATH"),
        (["--lora-modules", "attn=/nonexistent"], "names 'attn' twice"),
        (["--lora-modules", "z=/nonexistent"], "is not a folder"),
    ],
)
def test_bad_lora_options_are_one_line_usage_errors(
    shakespeare_model,
    adapters,
    tmp_path,
    capsys,
    extra,
    message,  # noqa: F811
):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": "a"}) + "\n")
    assert main(_argv(shakespeare_model, adapters, inp, tmp_path / "o.jsonl", *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_parquet_rows_pick_adapters_by_their_model_column(
    shakespeare_model,
    adapters,  # noqa: F811
    refs,
    tmp_path,
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = [None, "attn", "mlp", "nope"]
    inp, out = tmp_path / "in.parquet", tmp_path / "out.jsonl"
    pq.write_table(pa.table({"prompt": [TEXTS[2]] * 4, "model": names}), inp)
    assert main(_argv(shakespeare_model, adapters, inp, out)) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["token_ids"] for g in got[:3]] == [refs[n][2] for n in names[:3]]
    assert got[3]["error"]["code"] == "unknown_model"


def test_ray_replicas_serve_the_adapters(shakespeare_model, adapters, refs, tmp_path):  # noqa: F811
    """Two replicas on a local Ray cluster, each loading the adapters itself: the same rows as
    one process (which the tests above hold equal to merged PEFT)."""
    ray = pytest.importorskip("ray")
    rows = [r for r, _ in _simple_rows()[:10]] + [{"prompt": TEXTS[0], "model": "nope"}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(_argv(shakespeare_model, adapters, inp, tmp_path / "one.jsonl")) == 0
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)  # 2 replicas + reads
    try:
        ray_args = ["--ray", "--replicas", "2", "--batch-rows", "3"]
        assert main(_argv(shakespeare_model, adapters, inp, tmp_path / "ray.jsonl", *ray_args)) == 0
    finally:
        ray.shutdown()
    assert (tmp_path / "ray.jsonl").read_bytes() == (tmp_path / "one.jsonl").read_bytes()


def test_the_vllm_backend_gets_the_adapters_by_name(
    shakespeare_model, adapters, tmp_path, monkeypatch
):  # noqa: F811
    """--backend vllm (tests/vllm_stub.py): vLLM's enable_lora, max_loras and max_lora_rank, and
    each row's LoRARequest (vLLM reads the folders itself)."""
    import vllm_stub

    stub = vllm_stub.install(monkeypatch)
    rows = [{"prompt": "a"}, {"prompt": "b", "lora": "mlp"}, {"prompt": "c", "model": "attn"}]
    rows.append({"prompt": "d", "model": "nope"})
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = _argv(shakespeare_model, adapters, inp, out, "--backend", "vllm", "--max-lora-rank", "8")
    assert main([a for a in argv if a not in ("--device", "cpu")]) == 0
    engine = stub.started[0]
    args = engine.args
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 2, 8)
    names = [None if r is None else (r.lora_name, r.lora_int_id, r.lora_path) for r in engine.loras]
    paths = {n: str(f) for n, f in adapters.items()}
    assert names == [None, ("mlp", 2, paths["mlp"]), ("attn", 1, paths["attn"])]
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert got[3]["error"]["code"] == "unknown_model"


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_the_vllm_cpu_build_gets_the_mixed_batch_notice(monkeypatch, device_type):
    """vLLM 0.32's CPU build decodes base rows beside adapter rows with an adapter's update
    (benchmarks/check_vllm_lora.py): the job says so there, and only there."""
    import vllm_stub

    from llmctl.batch.vllm_backend import CPU_MIXED_LORA_NOTE, VllmEngine

    vllm_stub.install(monkeypatch, device_type=device_type)
    engine = VllmEngine(engine=None, vllm=None)
    note = engine.register_loras({"a": "/adapters/a"})
    assert note == (CPU_MIXED_LORA_NOTE if device_type == "cpu" else None)
    assert engine.register_loras({}) is None
