"""Loading: folders, shards with an index, tied embeddings, one-line errors for unusable models."""

from __future__ import annotations

import json

import pytest
import torch

from llmctl.errors import ModelLoadError, RequestError
from llmctl.models.config import ModelConfig
from llmctl.runtime.loader import load_runtime
from llmctl.runtime.resolve import DEMO_MODEL_DIR, resolve_model_path
from llmctl.runtime.weights import load_model
from tests.conftest import make_random_model


def test_demo_model_is_the_default_and_bf16():
    from safetensors import safe_open

    from llmctl.kernels.cpu.features import native_bf16

    with safe_open(str(DEMO_MODEL_DIR / "model.safetensors"), framework="pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())  # shipped in bf16
    rt = load_runtime(None, device="cpu")
    # auto computes in bf16 where the CPU has native bf16 matmuls, in float32 where it has not
    assert rt.model_path == DEMO_MODEL_DIR
    assert rt.dtype == (torch.bfloat16 if native_bf16() else torch.float32)
    assert next(rt.model.parameters()).dtype == rt.dtype
    assert load_runtime(None, dtype="bfloat16", device="cpu").dtype == torch.bfloat16
    ids = rt.apply_chat_template([{"role": "user", "content": "Speak."}])
    assert rt.decode(ids).startswith("USER:\nSpeak.")


def test_sharded_checkpoint_with_index_equals_single_file(tmp_path):
    from transformers import AutoModelForCausalLM

    single = make_random_model(tmp_path / "single", "qwen2", tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_pretrained(single)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a, _ = load_model(single, "float32")
    b, cfg = load_model(tmp_path / "sharded", "float32")
    assert cfg.tie_word_embeddings and b.lm_head.weight is b.model.embed_tokens.weight
    ids = torch.tensor([[3, 4, 5, 6]])
    assert torch.equal(a.forward_dense(ids), b.forward_dense(ids))


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt5000"}))
    with pytest.raises(ModelLoadError, match="supported: llama, mistral, qwen2, qwen3"):
        load_model(tmp_path)


def test_a_transformers_path_model_without_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="no .safetensors weights"):
        load_model(tmp_path)


def test_pickle_only_checkpoint_is_refused(tmp_path):
    make_random_model(tmp_path, "llama")
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="never pickle"):
        load_model(tmp_path)


def test_missing_folder_and_offline_hub_id_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="pass the local folder"):
        resolve_model_path("someorg/somemodel")


def test_unknown_chat_role_is_a_request_error():
    rt = load_runtime(None, device="cpu")
    with pytest.raises(RequestError) as e:
        rt.apply_chat_template([{"role": "wizard", "content": "hi"}])
    assert e.value.code == "unknown_role"


def test_config_spellings_of_rope():
    base = dict(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    old = ModelConfig.from_dict(
        {**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    )
    new = ModelConfig.from_dict(
        {**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}
    )
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling["factor"] == new.rope_scaling["factor"] == 8.0
    yarn = ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert yarn.native and yarn.rope_scaling["rope_type"] == "yarn"
    dynamic = {**base, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}
    dynamic = ModelConfig.from_dict(dynamic)  # native, serving 4x the trained context
    assert dynamic.native and dynamic.max_position_embeddings == 4 * 2048
    assert dynamic.rope_scaling["original_max_position_embeddings"] == 2048
    other = {**base, "rope_scaling": {"rope_type": "proportional", "factor": 4.0}}
    other = ModelConfig.from_dict(other)
    assert not other.native and "RoPE scaling 'proportional' is not native" in other.not_native


def test_weights_are_owned_aligned_copies_not_views_of_the_file(tmp_path):
    folder = make_random_model(tmp_path, "llama", seed=2)
    model, _ = load_model(folder, dtype="float32")
    params = list(model.parameters())
    # safetensors data sits at the file's (8-byte) alignment; our own allocations are 64-byte
    # aligned
    assert all(p.data_ptr() % 64 == 0 for p in params)
    file_bytes = (folder / "model.safetensors").read_bytes()
    before = params[0].detach().clone()
    (folder / "model.safetensors").write_bytes(file_bytes[:-4096] + bytes(4096))  # the file changes
    assert torch.equal(params[0].detach(), before)
