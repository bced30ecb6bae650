"""GGUF files of every family the conversion takes (issue 36): a tiny random transformers model
(tests/archs.py, with the demo tokenizer's vocabulary) written as llama.cpp's converter writes
it (tests/gguf_writer.py: its names, q/k permutes, +1 Gemma norms, stacked experts, transposed
GPT-2 weights and metadata keys) converts back to the original weights exactly, with the
config that builds the same model, and run-batch serves it token for token as the original
folder in float32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from archs import save_clear_model
from gguf_writer import write_gguf

from llmctl.cli import main
from llmctl.runtime.resolve import DEMO_MODEL_DIR, resolve_model_path

gguf = pytest.importorskip("gguf")

DEMO_VOCAB = dict(vocab_size=2048, bos_token_id=0, eos_token_id=0, pad_token_id=1)
# what real checkpoints of the family set and llama.cpp assumes: tied Gemma and GPT-2 heads,
# Qwen3-MoE routing weights renormalised (transformers' GGUF reader defaults it to True)
OVERRIDES = {
    "gemma2": dict(tie_word_embeddings=True),
    "gemma3_text": dict(tie_word_embeddings=True),
    "gpt2": dict(tie_word_embeddings=True),
    "falcon": dict(tie_word_embeddings=True),
    "qwen3_moe": dict(norm_topk_prob=True),
}
FAMILIES = (
    "mistral", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "starcoder2",
    "stablelm", "gpt2", "falcon",
)  # fmt: skip
# config values the converted folder must keep (where the original config.json has them)
KEPT = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
    "num_experts", "num_experts_per_tok", "norm_topk_prob", "attn_logit_softcapping",
    "final_logit_softcapping", "query_pre_attn_scalar", "sliding_window", "rope_parameters",
    "layer_types", "use_parallel_residual", "use_qkv_bias", "n_positions", "n_embd", "n_layer",
    "tie_word_embeddings", "num_kv_heads", "new_decoder_architecture", "multi_query",
    "parallel_attn", "num_ln_in_parallel_attn", "ffn_hidden_size", "bias", "alibi",
)  # fmt: skip
GPT2_KEPT = ("n_positions", "n_embd", "n_layer", "n_head")  # archs.py's other keys are unused
PROMPTS = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [12, 13, 14], [300, 1200, 7, 7, 7])


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _original(tmp_path: Path, arch: str) -> Path:
    folder, _ = save_clear_model(tmp_path / arch, arch, **DEMO_VOCAB, **OVERRIDES.get(arch, {}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL_DIR / name, folder / name)
    return folder


def _tokens(tmp_path: Path, model: Path, name: str) -> list[list[int]]:
    prompts = tmp_path / f"{name}-p.jsonl"
    rows = [{"id": str(i), "prompt_token_ids": list(p)} for i, p in enumerate(PROMPTS)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / f"{name}.jsonl"
    args = ["run-batch", str(prompts), "-o", str(out), "-m", str(model), "-q", "--max-tokens", "8"]
    args += ["--dtype", "float32", "--device", "cpu", "--include-token-ids", "--ignore-eos"]
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["error"] is None and len(r["token_ids"]) == 8 for r in rows), rows
    return [r["token_ids"] for r in sorted(rows, key=lambda r: r["id"])]


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_converts_to_the_same_weights_config_and_tokens(tmp_path, arch):
    original = _original(tmp_path, arch)
    converted = resolve_model_path(write_gguf(original, tmp_path / f"{arch}.gguf"))
    want, got = _weights(original), _weights(converted)
    if arch == "gpt2":  # llama.cpp writes GPT-2's tied head as its own output tensor
        assert got.pop("lm_head.weight").equal(want["transformer.wte.weight"])
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].equal(t), name
    config = json.loads((original / "config.json").read_text())
    new = json.loads((converted / "config.json").read_text())
    assert new["architectures"] == config["architectures"] or arch == "mistral"
    kept = {k: config[k] for k in (GPT2_KEPT if arch == "gpt2" else KEPT) if k in config}
    if arch == "falcon":  # archs.py's intermediate_size, which Falcon does not read
        kept.pop("intermediate_size")
    if arch == "mistral":  # written as llama, served as llama (a window past these prompts)
        assert new["architectures"] == ["LlamaForCausalLM"]
        kept.pop("sliding_window")
    new.setdefault("head_dim", new.get("hidden_size", 0) // new.get("num_attention_heads", 1))
    assert {k: new.get(k) for k in kept} == kept
    assert _tokens(tmp_path, converted, "gguf") == _tokens(tmp_path, original, "folder")


def test_quantized_stacked_experts_split_per_expert(tmp_path):
    """Q8_0 matrices, stacked experts included, dequantize to the values gguf's own
    dequantizer gives, split per expert, in bfloat16."""
    import gguf
    import torch

    original = _original(tmp_path, "qwen3_moe")
    converted = resolve_model_path(write_gguf(original, tmp_path / "q8.gguf", quantize=True))
    got = _weights(converted)
    q = gguf.GGMLQuantizationType.Q8_0
    for name, t in _weights(original).items():
        a = t.numpy()
        if a.ndim == 2 and a.shape[-1] % 32 == 0:
            a = gguf.quants.dequantize(gguf.quants.quantize(a, q), q)
        assert got[name].dtype == torch.bfloat16, name
        assert got[name].equal(torch.from_numpy(a).to(torch.bfloat16)), name
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in got
    assert len(_tokens(tmp_path, converted, "q8")) == len(PROMPTS)


@pytest.mark.parametrize(
    "extra, message",
    [
        (lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN), "rope scaling 'yarn'"),
        (lambda w: w.add_expert_count(8), "llama with experts (Mixtral) is not supported"),
    ],
)
def test_what_is_not_converted_is_one_line_exit_2(tmp_path, capsys, cache, extra, message):
    path = write_gguf(_original(tmp_path, "mistral"), tmp_path / "m.gguf", extra=extra)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    capsys.readouterr()  # save_pretrained's progress bar
    code = main(["run-batch", str(prompts), "-o", str(tmp_path / "o.jsonl"), "-m", str(path), "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0] and "m.gguf" in err[0], err
    assert not list((cache / "gguf").iterdir())
