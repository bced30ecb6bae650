"""GGUF files as MODEL: the demo model written as a llama.cpp GGUF (q/k permuted as llama.cpp's
converter does, tokenizer and chat template in the metadata) serves token for token as the demo
folder does; the conversion is cached, never touches the user's file, and every bad case is one
line with exit 2."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from gguf_writer import add_tokenizer

from llmctl.cli import main
from llmctl.errors import ModelLoadError
from llmctl.runtime import gguf as gguf_mod
from llmctl.runtime.resolve import DEMO_MODEL_DIR, resolve_model_path

pytest.importorskip("gguf")

LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(hf: str) -> str:
    if hf in TOP:
        return TOP[hf]
    _, _, i, *rest = hf.split(".")
    kind = ".".join(rest[:-1])
    return f"blk.{i}.{LAYER[kind]}.{rest[-1]}"


def _permute(w, n_head: int):
    # llama.cpp convert_hf_to_gguf.LlamaModel.permute: rotary halves interleaved
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_demo_gguf(path: Path, quantize: bool = False) -> Path:
    """The demo model as a llama.cpp GGUF: float32 tensors (the bf16 weights exactly), or Q8_0
    matrices when `quantize`."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    cfg = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("demo")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    add_tokenizer(w, DEMO_MODEL_DIR)
    for name, t in load_file(str(DEMO_MODEL_DIR / "model.safetensors")).items():
        a = t.float().numpy()
        if "q_proj" in name or "k_proj" in name:
            a = _permute(a, heads if "q_proj" in name else kv)
        if quantize and a.ndim == 2:
            q = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def demo_gguf(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("user")
    return write_demo_gguf(folder / "demo-f32.gguf")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LLMCTL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _run(tmp_path: Path, model: Path, name: str) -> list[dict]:
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"id": "romeo", "prompt": "ROMEO:\n", "max_tokens": 24},
        {"id": "king", "prompt": "KING RICHARD III:\nNow is the winter", "max_tokens": 24},
        {"id": "chat", "messages": [{"role": "user", "content": "Speak, friend."}]},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / f"{name}.jsonl"
    args = ["run-batch", str(prompts), "-o", str(out), "-m", str(model), "-q"]
    args += ["--dtype", "float32", "--device", "cpu", "--include-token-ids", "--max-tokens", "16"]
    assert main(args) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_gguf_serves_as_the_demo_folder_token_for_token(tmp_path, demo_gguf):
    user_files = {p: p.stat().st_mtime_ns for p in demo_gguf.parent.iterdir()}
    from_gguf = _run(tmp_path, demo_gguf, "gguf")
    from_folder = _run(tmp_path, DEMO_MODEL_DIR, "folder")
    assert [r["token_ids"] for r in from_gguf] == [r["token_ids"] for r in from_folder]
    assert [r["text"] for r in from_gguf] == [r["text"] for r in from_folder]
    assert all(r["error"] is None and r["token_ids"] for r in from_gguf)
    # nothing written beside the user's file, and the file itself untouched
    assert {p: p.stat().st_mtime_ns for p in demo_gguf.parent.iterdir()} == user_files


def test_folder_with_one_gguf_and_the_cache_is_reused(tmp_path, demo_gguf, monkeypatch, cache):
    first = resolve_model_path(demo_gguf)
    assert first.parent.parent == cache and (first / "model.safetensors").is_file()
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".")]  # no temp left

    def no_second_conversion(*a):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_mod, "_convert", no_second_conversion)
    assert resolve_model_path(demo_gguf) == first
    assert resolve_model_path(demo_gguf.parent) == first  # the folder holding only it


def test_folder_with_two_ggufs_is_one_line(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="2 .gguf files"):
        resolve_model_path(tmp_path)


def test_quantized_matrices_become_bfloat16(tmp_path):
    from safetensors import safe_open

    folder = resolve_model_path(write_demo_gguf(tmp_path / "q8.gguf", quantize=True))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype.is_floating_point
        assert str(f.get_tensor("model.norm.weight").dtype) == "torch.bfloat16"
    assert json.loads((folder / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"


@pytest.mark.parametrize("keep", [100, 0.6])
def test_truncated_gguf_is_one_line_exit_2(tmp_path, demo_gguf, capsys, cache, keep):
    data = demo_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    code = main(["run-batch", str(prompts), "-o", str(tmp_path / "o.jsonl"), "-m", str(cut), "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cut.gguf" in err[0], err
    assert not (cache / "gguf").exists() or not list((cache / "gguf").iterdir())


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_head_count(4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="'phi2' is not supported"):
        resolve_model_path(path)


def test_missing_gguf_package_says_what_to_install(tmp_path, demo_gguf, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(ModelLoadError, match=r"pip install 'llmctl\[gguf\]'"):
        resolve_model_path(demo_gguf)
    assert os.path.exists(demo_gguf)
