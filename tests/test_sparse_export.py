"""A pruned model saves as an ordinary dense HF folder that transformers and llmctl both load."""

from __future__ import annotations

import json

import pytest
import torch

from llmctl.compress.sparse.export import save_dense_model, sparsity_config
from llmctl.compress.sparse.masks import parse_pattern
from llmctl.compress.sparse.model import SparsifySettings, sparsify_model, target_linears
from llmctl.runtime.semi_structured import (
    accelerate_2of4,
    satisfies_nm,
    semi_structured_support,
    shape_supported,
)
from llmctl.runtime.weights import load_model
from tests.conftest import make_random_model


def test_target_linears_ignore_and_width(tmp_path):
    src = make_random_model(tmp_path / "src", "llama", intermediate_size=90)  # 90 % 4 != 0
    model, _ = load_model(src, "float32", "cpu")
    t = target_linears(
        model,
        SparsifySettings(parse_pattern("2:4", None), "magnitude", ignore=("q_proj", "layers.1.*")),
    )
    assert (
        "model.layers.0.mlp.down_proj" in t.skipped
        and "90 inputs" in t.skipped["model.layers.0.mlp.down_proj"]
    )
    assert t.skipped["model.layers.0.self_attn.q_proj"].startswith("ignored")
    assert all(n.startswith("model.layers.0.") for n in t.names)
    assert "model.layers.0.mlp.up_proj" in t.names and "lm_head" not in t.names


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_saved_sparse_model_loads_in_transformers_with_same_logits(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    src = make_random_model(tmp_path / "src", arch, tie_word_embeddings=arch == "qwen3")
    model, config = load_model(src, "float32", "cpu")
    pattern = parse_pattern("2:4", None)
    res = sparsify_model(model, SparsifySettings(pattern, "magnitude"))
    lines, targets = res.lines, res.targets
    assert len(lines) == 14 and all(line.pattern_ok for line in lines)
    meta = sparsity_config(pattern, "magnitude", {l.name: l.sparsity for l in lines}, [], 0.5)
    out = save_dense_model(model, config.raw, src, tmp_path / "out", {"sparsity_config": meta})

    saved = json.loads((out / "config.json").read_text())
    assert (
        saved["sparsity_config"]["pattern"] == "2:4"
        and saved["sparsity_config"]["method"] == "magnitude"
    )
    assert set(saved["sparsity_config"]["layers"]) == set(targets.names)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for name in targets.names:
        assert satisfies_nm(hf.get_submodule(name).weight, 2, 4), name
    ids = torch.randint(3, 160, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.forward_dense(ids), rtol=1e-4, atol=1e-4)
    again, _ = load_model(out, "float32", "cpu")  # and llmctl reads its own output
    assert torch.equal(
        again.model.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight
    )


def test_export_keeps_checkpoint_dtype_and_tied_embeddings(tmp_path):
    from safetensors import safe_open

    src = make_random_model(tmp_path / "src", "llama", tie_word_embeddings=True)
    raw = json.loads((src / "config.json").read_text())
    raw["torch_dtype"] = "bfloat16"
    model, _ = load_model(src, "float32", "cpu")
    out = save_dense_model(model, raw, src, tmp_path / "out", {})
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_semi_structured_path_stays_dense_on_cpu(tmp_path):
    ok, why = semi_structured_support("cpu")
    assert not ok and "CPU" in why
    src = make_random_model(tmp_path / "src", "llama", hidden_size=64, intermediate_size=128)
    model, _ = load_model(src, "float32", "cpu")
    sparsify_model(model, SparsifySettings(parse_pattern("2:4", None), "magnitude"))
    before = model.model.layers[0].mlp.up_proj.weight
    decisions = accelerate_2of4(model, ["model.layers.0.mlp.up_proj"])
    assert [d.converted for d in decisions] == [False]
    assert model.model.layers[0].mlp.up_proj.weight is before
    half = model.model.layers[0].mlp.up_proj.weight.detach().half()
    assert shape_supported(half)  # [128, 64], 2:4, fp16
    assert not shape_supported(half.float()) and not shape_supported(half[:, :60])


def test_semi_structured_decisions_follow_the_timer(tmp_path, monkeypatch):
    """The CUDA path's choice logic, with the device check, conversion and timing faked on the
    CPU."""
    import llmctl.runtime.semi_structured as ss

    src = make_random_model(tmp_path / "src", "llama", hidden_size=64, intermediate_size=128)
    model, config = load_model(src, "float16", "cpu")
    res = sparsify_model(model, SparsifySettings(parse_pattern("2:4", None), "magnitude"))
    monkeypatch.setattr(ss, "semi_structured_support", lambda device: (True, ""))
    monkeypatch.setattr(torch.sparse, "to_sparse_semi_structured", lambda w: w.clone())
    calls = []

    def timer(w, tokens):  # [128, 64] gate/up measured faster sparse; [64, 64] and [64, 128] not
        calls.append(tuple(w.shape))
        return (2.0, 1.0) if tuple(w.shape) == (128, 64) else (1.0, 1.0)

    names = res.targets.names
    decisions = ss.accelerate_2of4(model, names, timer=timer)
    converted = {d.name for d in decisions if d.converted}
    assert converted == {n for n in names if n.endswith(("gate_proj", "up_proj"))}
    assert len(calls) == len(set(calls))  # each shape timed once
    raw = dict(
        config.raw,
        sparsity_config=sparsity_config(
            parse_pattern("2:4", None), "magnitude", {n: 0.5 for n in names}, [], 0.5
        ),
    )
    assert len(ss.accelerate_from_config(model, raw, timer=timer)) == len(names)
    raw["sparsity_config"]["pattern"] = "4:8"
    assert (
        ss.accelerate_from_config(model, raw, timer=timer) == []
    )  # only 2:4 has sparse tensor cores


def test_loader_sends_2of4_checkpoints_through_the_semi_structured_path(tmp_path, monkeypatch):
    """load_model (so LLM and run-batch) tries the sparse path on a saved 2:4 checkpoint; dense ones
    skip it."""
    import llmctl.runtime.semi_structured as ss

    src = make_random_model(tmp_path / "src", "llama", hidden_size=64, intermediate_size=128)
    model, config = load_model(src, "float16", "cpu")
    assert not hasattr(model, "semi_structured")
    pattern = parse_pattern("2:4", None)
    res = sparsify_model(model, SparsifySettings(pattern, "magnitude"))
    meta = sparsity_config(pattern, "magnitude", {l.name: l.sparsity for l in res.lines}, [], 0.5)
    out = save_dense_model(model, config.raw, src, tmp_path / "out", {"sparsity_config": meta})

    on_cpu, _ = load_model(out, "float16", "cpu")  # the real CPU answer: all dense, reason given
    assert len(on_cpu.semi_structured) == len(res.targets.names)
    assert (
        not any(d.converted for d in on_cpu.semi_structured)
        and "CPU" in on_cpu.semi_structured[0].reason
    )

    monkeypatch.setattr(ss, "semi_structured_support", lambda device: (True, ""))
    monkeypatch.setattr(torch.sparse, "to_sparse_semi_structured", lambda w: w.clone())
    monkeypatch.setattr(
        ss,
        "time_dense_vs_sparse",
        lambda w, tokens: (3.0, 1.0) if w.shape[0] == 128 else (1.0, 1.0),
    )
    faked, _ = load_model(out, "float16", "cpu")
    converted = {d.name for d in faked.semi_structured if d.converted}
    assert converted == {n for n in res.targets.names if n.endswith(("gate_proj", "up_proj"))}


def test_gpu_benchmark_entry_point_skips_without_cuda(capsys):
    import importlib.util
    import json as _json
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: benchmarks/gpu_check.sh runs the real benchmark")
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_semi_structured.py"
    spec = importlib.util.spec_from_file_location("bench_semi_structured", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--shapes", "128x128", "--tokens", "4"]) == 0
    assert "skipped" in _json.loads(capsys.readouterr().out)


def test_wanda_norm_method_matches_hessian_diagonal(tmp_path):
    """The driver's O(in) Wanda statistics give the same masks as sqrt(diag H) from the GPTQ
    Hessian."""
    from llmctl.compress.driver import HessianMethod, calibrate_layers
    from llmctl.compress.sparse.prune import prune_linear

    src = make_random_model(tmp_path / "src", "llama", seed=5)
    calib = torch.randint(3, 160, (4, 24), generator=torch.Generator().manual_seed(1))
    pattern = parse_pattern("2:4", None)
    a, _ = load_model(src, "float32", "cpu")
    sparsify_model(a, SparsifySettings(pattern, "wanda"), calib)
    b, _ = load_model(src, "float32", "cpu")

    def fn(name, linear, hessian):
        new, line = prune_linear(name, linear.weight, pattern, "wanda", hessian)
        linear.weight.data.copy_(new)
        return line

    calibrate_layers(b, calib, HessianMethod(fn))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa == 0, pb == 0), name
