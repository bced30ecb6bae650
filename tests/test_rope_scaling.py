"""RoPE scalings that depend on the sequence (models/rope.py): LongRoPE (Phi-3's short and long
factors, switched at `original_max_position_embeddings`, and its attention factor) and dynamic
NTK, on our own model code: the tables equal transformers' rotary embeddings row for row, and
greedy tokens equal transformers' `generate` at contexts longer than the original."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from archs import COMMON, save_clear_model

from llmctl import LLM, SamplingParams
from llmctl.models.config import ModelConfig
from llmctl.models.rope import RotaryEmbedding

SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 4.0]  # head_dim 16: 8 factors each
LONG = [1.5, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0, 32.0]
LONGROPE = dict(
    rope_parameters={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG},
    original_max_position_embeddings=32,
    max_position_embeddings=128,
)
DYNAMIC = dict(
    rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    max_position_embeddings=32,
)


def _hf_config(arch: str, **kw):
    import transformers

    return transformers.AutoConfig.for_model(arch, **{**COMMON, **kw})


def _hf_rows(rotary, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin [n, head_dim] for one forward over positions 0..n-1."""
    x = torch.zeros(1, n, 16)
    cos, sin = rotary(x, torch.arange(n)[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("attention_factor", [None, 1.25])
def test_longrope_tables_equal_transformers(attention_factor):
    """Short factors for a context within the original, long ones past it, each scaled by the
    attention factor (by default sqrt(1 + ln(128 / 32) / ln 32))."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    kw = dict(LONGROPE)
    if attention_factor:
        kw["rope_parameters"] = {**kw["rope_parameters"], "attention_factor": attention_factor}
    hf = _hf_config("phi3", **kw)
    ours = RotaryEmbedding(ModelConfig.from_dict(hf.to_dict()))
    assert ours.long  # the model's context, 128, is past the original 32
    cos, sin = _hf_rows(Phi3RotaryEmbedding(hf), 40)
    torch.testing.assert_close((ours.cos[:40], ours.sin[:40]), (cos, sin))
    ours.fit(32)  # an engine capped at the original context: the short factors
    cos, sin = _hf_rows(Phi3RotaryEmbedding(hf), 32)
    torch.testing.assert_close((ours.cos[:32], ours.sin[:32]), (cos, sin))
    scale = attention_factor or (1 + torch.tensor(4.0).log() / torch.tensor(32.0).log()).sqrt()
    assert float(ours.cos[0, 0]) == pytest.approx(float(scale))


def test_dynamic_ntk_rows_equal_transformers_decode_steps():
    """Row p is what transformers' decode step at position p computes (the base grown for p + 1
    tokens past the original 32), the context served four times the original."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = _hf_config("llama", **DYNAMIC)
    config = ModelConfig.from_dict(hf.to_dict())
    assert config.native and config.max_position_embeddings == 128
    ours, theirs = RotaryEmbedding(config), LlamaRotaryEmbedding(hf)
    for n in (20, 32, 33, 50, 128):  # growing, as in generate
        cos, sin = _hf_rows(theirs, n)
        torch.testing.assert_close((ours.cos[n - 1], ours.sin[n - 1]), (cos[-1], sin[-1]))
    plain = RotaryEmbedding(dataclasses.replace(config, rope_scaling=None))
    assert torch.equal(ours.cos[:32], plain.cos[:32]) and not torch.allclose(ours.cos, plain.cos)


def _generate(folder, prompts, max_tokens: int, **kw) -> list[list[int]]:
    llm = LLM(str(folder), dtype="float32", device="cpu", **kw)
    assert type(llm.runtime.model).__name__ == "LlamaForCausalLM"
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def _prompts(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 160, (n,), generator=g).tolist() for n in lengths]


def test_phi3_longrope_greedy_equals_transformers(tmp_path):
    """Prompts longer than the original 32 (the long factors throughout, as transformers takes
    them), and with --max-model-len 32 short ones (the short factors throughout)."""
    prompts = _prompts(40, 50)
    folder, expected = save_clear_model(tmp_path / "a", "phi3", prompts, 16, **LONGROPE)
    assert _generate(folder, prompts, 16) == expected
    prompts = _prompts(10, 5)
    folder, expected = save_clear_model(tmp_path / "b", "phi3", prompts, 16, **LONGROPE)
    assert _generate(folder, prompts, 16, max_model_len=32) == expected


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dynamic_ntk_greedy_equals_transformers_past_the_original_context(tmp_path, arch):
    """Generation runs from within the original 32 positions to 51, chunked prefill on."""
    prompts = _prompts(20, 31, 5)
    folder, expected = save_clear_model(tmp_path, arch, prompts, 20, **DYNAMIC)
    assert _generate(folder, prompts, 20, max_num_batched_tokens=8) == expected
