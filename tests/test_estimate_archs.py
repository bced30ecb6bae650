"""`profile estimate` on configs our own model code does not run (issue 36): parameters counted
on the transformers model built on the meta device, MoE active parameters, and the KV cache shape
the engine's load-time probe finds (MLA: per-head decompressed K and V)."""

from __future__ import annotations

import json

import pytest
from archs import build

from llmctl.cli import main
from llmctl.models.config import ModelConfig
from llmctl.profiling.arch_shapes import arch_shapes
from llmctl.profiling.estimate import estimate
from llmctl.runtime.weights import load_model

ARCHS = ("gemma2", "phi", "gpt2", "falcon", "qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3")


@pytest.mark.parametrize("arch", ARCHS)
def test_shapes_match_the_loaded_model(tmp_path, arch):
    model = build(arch, num_key_value_heads=None) if arch == "gpt2" else build(arch)
    model.save_pretrained(tmp_path)
    config = ModelConfig.from_file(tmp_path / "config.json")
    shapes = arch_shapes(config)
    _, served = load_model(tmp_path, "float32", "cpu")
    assert (shapes.kv_layers, shapes.kv_heads, shapes.kv_width) == (
        served.num_layers,
        served.num_kv_heads,
        served.head_dim,
    )
    assert shapes.num_parameters == sum(p.numel() for p in model.parameters())
    e = estimate(config, dtype="int4", group_size=16)
    assert e.num_parameters == shapes.num_parameters and e.weights.other > 0
    if arch in ("qwen2_moe", "mixtral", "gpt_oss", "deepseek_v3"):
        assert shapes.dense_experts > 0
        assert shapes.num_parameters - shapes.dense_experts < e.active_parameters
        assert e.active_parameters < shapes.num_parameters
    else:
        assert e.active_parameters is None and shapes.dense_experts == 0
    if arch == "deepseek_v3":
        assert any(n.startswith("MLA:") for n in e.notes)


def test_cli_estimate_of_an_moe_model(tmp_path, capsys):
    build("qwen3_moe").save_pretrained(tmp_path)
    rc = main(
        [
            "profile",
            "estimate",
            str(tmp_path),
            "--dtype",
            "int4",
            "--group-size",
            "16",
            "--report-json",
            "-",
        ]
    )
    assert rc == 0
    record = json.loads(capsys.readouterr().out)
    est = record["estimate"]
    assert est["active_parameters"] < est["num_parameters"]
    assert any("fused expert" in n for n in est["notes"])
