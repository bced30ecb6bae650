"""`profile --estimate`: parameter, weight and KV arithmetic from config.json alone."""

from __future__ import annotations

import json
import math

import pytest

from llmctl.cli import main
from llmctl.errors import ModelLoadError, UsageError
from llmctl.models.config import ModelConfig
from llmctl.profiling import estimate as est
from tests.conftest import shared_path

TINY = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def test_llama2_7b_fp16_weights_and_kv():
    config, _ = est.find_config(str(shared_path("configs/llama-2-7b.json")))
    e = est.estimate(config, dtype="fp16", seq_len=4096, batch=2)
    assert config.num_parameters() == 6_738_415_616
    assert e.weights.total == 2 * config.num_parameters()
    assert 13.4e9 < e.weights.total < 13.6e9  # "about 13.5 GB"
    assert e.kv_bytes_per_token == 512 * 1024
    assert e.kv_bytes_per_sequence == 4096 * 512 * 1024  # 2 GiB
    assert e.kv_bytes_batch == 2 * e.kv_bytes_per_sequence


def test_llama3_8b_gqa_kv_per_token():
    config, _ = est.find_config(str(shared_path("configs/llama-3-8b.json")))
    assert est.kv_bytes_per_token(config, "bf16") == 128 * 1024
    assert est.kv_bytes_per_token(config, "fp8") == 64 * 1024


def test_int4_group128_counts_scales_and_zeros_exactly():
    config = ModelConfig.from_dict(TINY)
    w = est.weight_bytes(config, "int4", group_size=32)
    # one layer's linears: q 64x64, k 32x64, v 32x64, o 64x64, gate/up 96x64, down 64x96
    shapes = [(64, 64), (32, 64), (32, 64), (64, 64), (96, 64), (96, 64), (64, 96)]
    elems = sum(o * i for o, i in shapes)
    groups = sum(o * math.ceil(i / 32) for o, i in shapes)
    assert w.linear == 2 * elems // 2  # 2 layers x 4 bits
    assert w.scales == 2 * groups * 2  # a 16-bit scale per group
    assert w.zeros == 2 * groups // 2  # a 4-bit zero point per group
    assert w.embeddings == 2 * 100 * 64 * 2  # embed + lm_head stay 16-bit
    assert w.total == w.linear + w.scales + w.zeros + w.embeddings + w.other
    # norms: 2 per layer + final, 16-bit
    assert w.other == (2 * 2 * 64 + 64) * 2


def test_int4_on_llama2_is_bigger_than_bare_nibbles_and_group_size_matters():
    config, _ = est.find_config(str(shared_path("configs/llama-2-7b.json")))
    g128 = est.weight_bytes(config, "int4", 128)
    g32 = est.weight_bytes(config, "int4", 32)
    channel = est.weight_bytes(config, "int4", None)
    assert g128.scales > 0 and g128.zeros > 0
    assert g32.scales == 4 * g128.scales
    assert channel.scales < g128.scales
    assert 3.7e9 < g128.total < 4.0e9
    emb = est.weight_bytes(config, "int4", 128, quantize_embeddings=True)
    assert emb.embeddings < g128.embeddings / 3


def test_16bit_bytes_match_a_real_model_and_tied_embeddings():
    from llmctl.models.llama import LlamaForCausalLM

    for tied in (False, True):
        config = ModelConfig.from_dict({**TINY, "tie_word_embeddings": tied, "model_type": "qwen2"})
        model = LlamaForCausalLM(config)
        unique = {id(p): p for p in model.parameters()}.values()
        assert config.num_parameters() == sum(p.numel() for p in unique)
        assert est.weight_bytes(config, "bf16").total == sum(p.numel() * 2 for p in unique)
        assert est.weight_bytes(config, "fp32").total == sum(p.numel() * 4 for p in unique)
        del model


def test_memory_fit_and_bandwidth_ceiling():
    config = ModelConfig.from_dict(TINY)
    per_tok = est.kv_bytes_per_token(config, "bf16")  # 2 x 2 layers x 2 heads x 16 dims x 2 bytes
    assert per_tok == 256
    e = est.estimate(
        config,
        dtype="bf16",
        seq_len=100,
        batch=3,
        block_size=16,
        memory_budget=10**6,
        bandwidth=1e9,
    )
    assert e.kv_bytes_per_sequence == 112 * 256  # rounded up to 7 blocks of 16
    assert e.max_sequences == (10**6 - e.weights.total) // (112 * 256)
    step = e.weights.total + 3 * 100 * 256
    assert e.decode_bytes_per_step == step
    assert e.decode_tokens_per_s_per_sequence == pytest.approx(1e9 / step)
    assert e.decode_tokens_per_s_aggregate == pytest.approx(3e9 / step)
    tight = est.estimate(config, seq_len=100, memory_budget=e.weights.total - 1)
    assert tight.max_sequences == 0


def test_parsers():
    assert est.parse_bandwidth("900") == 900e9
    assert est.parse_bandwidth("3.35TB/s") == pytest.approx(3.35e12)
    assert est.parse_bandwidth("100 GiB/s") == 100 * 1024**3
    assert est.parse_group_size("channel") is None and est.parse_group_size("64") == 64
    for bad in (
        lambda: est.parse_bandwidth("fast"),
        lambda: est.parse_group_size("0"),
        lambda: est.normalize_dtype("int3", est.WEIGHT_BITS, "weight dtype"),
    ):
        with pytest.raises(UsageError):
            bad()


def test_find_config_folder_file_and_offline_hub(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(TINY))
    assert est.find_config(str(tmp_path / "m"))[0].hidden_size == 64
    assert est.find_config(str(tmp_path / "m" / "config.json"))[0].num_layers == 2
    with pytest.raises(ModelLoadError, match="no such file"):
        est.find_config(str(tmp_path / "missing.json"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty hub cache
    with pytest.raises(ModelLoadError, match="offline"):
        est.find_config("someone/not-cached-model")


def test_cli_estimate_prints_and_writes_json(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    out = tmp_path / "e.json"
    rc = main(
        [
            "profile",
            "--estimate",
            str(cfg),
            "--dtype",
            "int4",
            "--group-size",
            "32",
            "--seq-len",
            "64",
            "--batch",
            "4",
            "--memory",
            "1MiB",
            "--bandwidth",
            "100",
            "--report-json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "KV per token" in text and "decode ceiling" in text
    record = json.loads(out.read_text())
    assert record["schema"] == "llmctl.profile.estimate" and record["schema_version"] == 1
    assert record["estimate"]["dtype"] == "int4" and record["estimate"]["group_size"] == 32
    assert record["estimate"]["kv_bytes_per_token"] == 256
    assert record["estimate"]["weights"]["scales"] > 0
    assert record["environment"]["llmctl_version"] and "kv_bytes_per_token" in record["formulas"]
    assert main(["profile", "--estimate", str(cfg), "--dtype", "int3"]) == 2
    assert main(["profile", "--estimate"]) == 2
