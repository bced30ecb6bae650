"""`profile estimate` on families beyond the Llama layout (issue 36): parameters equal the real
model's, MoE active parameters and the experts a decode step reads, the KV the engine allocates,
MLA's latent and sliding-window sizes as extra fields, on tiny random models (tests/archs.py)."""

from __future__ import annotations

import json
import math

import pytest
from archs import NATIVE, build

from llmctl.cli import main
from llmctl.models.config import ModelConfig
from llmctl.profiling import estimate as est
from llmctl.profiling.arch_counts import arch_counts

ARCHS = ("gemma3_text", "qwen3_moe", "mixtral", "deepseek_v3", "gpt2", "phi3")


def _config(model) -> ModelConfig:
    return ModelConfig.from_dict(model.config.to_dict())


def _routed_expert_params(model) -> int:
    """Parameters of the routed experts (not the shared ones), all layers."""
    return sum(
        p.numel()
        for n, p in model.named_parameters()
        if ".experts." in n and "shared_expert" not in n
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_parameter_counts_equal_the_real_model(arch):
    model = build(arch)
    config = _config(model)
    total = sum(p.numel() for p in model.parameters())
    assert config.native == (arch in NATIVE)  # native MoE and Gemma: counted as the rest
    assert not config.native or config.num_parameters() == total
    assert est.num_parameters(config) == total
    e = est.estimate(config, dtype="bf16", seq_len=64)
    assert e.num_parameters == total
    assert e.weights.total == 2 * total  # every parameter 16-bit
    assert est.weight_bytes(config, "fp32").total == 4 * total
    routed = _routed_expert_params(model)
    assert e.active_parameters == total - routed + routed * 2 // 4  # k=2 of E=4
    assert (e.active_parameters < total) == (routed > 0)


def test_tied_embeddings_count_once():
    model = build("gpt2", tie_word_embeddings=True)
    config = _config(model)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert est.num_parameters(config) == sum(p.numel() for p in model.parameters())
    assert est.weight_bytes(config).embeddings == 160 * 64 * 2


def test_moe_active_parameters_and_decode_bytes():
    config = _config(build("qwen3_moe"))
    # routed experts per layer: gate_up [4, 64, 64] + down [4, 64, 32] = 24576, two layers
    total = est.num_parameters(config)
    assert est.active_parameters(config) == total - 2 * 24576 // 2
    e = est.estimate(config, dtype="bf16", seq_len=64, batch=3, bandwidth=1e9)
    assert (e.num_experts, e.experts_per_token) == (4, 2)
    assert e.expert_weight_bytes == 2 * 2 * 24576
    assert e.decode_experts_touched == pytest.approx(4 * (1 - 0.5**3))
    kv = 3 * 64 * e.kv_bytes_per_token
    read = math.ceil(e.expert_weight_bytes * (1 - 0.5**3))
    assert e.decode_bytes_per_step == e.weights.total - e.expert_weight_bytes + read + kv
    one = est.estimate(config, dtype="bf16", seq_len=64, batch=1)
    assert one.decode_experts_touched == pytest.approx(2.0)  # k of E at batch 1
    # int4 packs attention's matrices and the routed experts, as quantize does (it unfuses
    # qwen3_moe's experts); the routers ([4, 64] each) stay 16-bit
    q = est.weight_bytes(config, "int4", group_size=16)
    assert q.linear == 2 * 12288 // 2 + 2 * 24576 // 2
    assert q.other == (total - 2 * 12288 - 2 * 24576 - 2 * 160 * 64) * 2
    # deepseek_v3's experts stay fused and dense: 16-bit in the estimate too
    ds = _config(build("deepseek_v3"))
    assert not arch_counts(ds).experts_packed and arch_counts(config).experts_packed


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_per_token_is_what_the_engine_allocates(tmp_path, arch):
    from llmctl import LLM

    build(arch).save_pretrained(tmp_path)
    config = ModelConfig.from_file(tmp_path / "config.json")
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", kv_cache_memory=1 << 20)
    runner = llm.engine.runner
    assert est.kv_bytes_per_token(config, "float32") == runner.bytes_per_block // runner.block_size


def test_mla_latent_and_sliding_window_fields():
    mla = est.estimate(_config(build("deepseek_v3")), dtype="fp32", seq_len=100)
    # the engine caches decompressed K/V: 4 heads x max(24, 16) per layer, K and V
    assert mla.kv_bytes_per_token == 2 * 2 * 4 * 24 * 4
    assert mla.kv_bytes_per_token_mla_latent == 2 * (32 + 8) * 4  # kv_lora_rank + rope dims
    assert mla.kv_bytes_per_sequence_windowed is None
    sw = est.estimate(_config(build("gemma3_text")), dtype="fp32", seq_len=100, block_size=16)
    assert sw.kv_bytes_per_sequence == 112 * sw.kv_bytes_per_token  # every token, today
    # both layers slide over 8 tokens: one block of 16 each, half the per-token bytes each
    assert sw.kv_bytes_per_sequence_windowed == 2 * 16 * sw.kv_bytes_per_token // 2
    assert sw.kv_bytes_per_token_mla_latent is None and sw.num_experts == 0
    mixed = est.estimate(_config(build("gpt_oss")), dtype="fp32", seq_len=100, block_size=16)
    assert mixed.kv_bytes_per_sequence_windowed == (16 + 112) * mixed.kv_bytes_per_token // 2


def test_native_estimates_carry_no_family_fields():
    config = ModelConfig.from_dict(build("llama").config.to_dict())
    e = est.estimate(config, seq_len=64)
    assert config.native and e.active_parameters == e.num_parameters == config.num_parameters()
    assert e.num_experts == e.expert_weight_bytes == 0
    assert e.kv_bytes_per_token_mla_latent is None and e.kv_bytes_per_sequence_windowed is None


def test_cli_estimate_of_a_moe_folder_prints_the_new_fields(tmp_path, capsys):
    build("deepseek_v3").save_pretrained(tmp_path / "m")
    out = tmp_path / "e.json"
    args = ["profile", "estimate", str(tmp_path / "m"), "--dtype", "int4", "--group-size", "16"]
    rc = main([*args, "--seq-len", "64", "--batch", "4", "--bandwidth", "100"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "active parameters per token" in text and "experts read per layer" in text
    assert "MLA latent per token" in text
    assert main([*args, "--report-json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["estimate"]["num_experts"] == 4
    assert record["estimate"]["kv_bytes_per_token_mla_latent"] == 2 * 40 * 2  # bf16 KV
    assert "decode_experts_touched" in record["formulas"]
    assert main([*args[:4], "int4", "--group-size", "128"]) == 2  # 64 inputs: quantize refuses
    assert "decoder matrix" in capsys.readouterr().err
