"""Every decoder architecture transformers builds runs in the engine (issue 36): our own model
code for the native families, transformers' modeling code on our paged KV cache for the rest,
with greedy tokens equal to transformers' `generate`, token for token, in float32."""

from __future__ import annotations

import json

import pytest
from archs import ARCHS, NATIVE, PROMPTS, save_clear_model

from llmctl import LLM, SamplingParams
from llmctl.errors import ModelLoadError, UsageError

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _generate(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers_generate(tmp_path, arch):
    folder, expected = save_clear_model(tmp_path, arch)
    llm = LLM(str(folder), dtype="float32", device="cpu")
    native = type(llm.runtime.model).__name__ == "LlamaForCausalLM"
    assert native == (arch in NATIVE)
    assert _generate(llm) == expected


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_olmoe_routing_with_and_without_renormalisation_is_native(tmp_path, norm_topk_prob):
    """OLMoE's router as each config sets it (its q/k norms span the whole projection)."""
    folder, expected = save_clear_model(tmp_path, "olmoe", norm_topk_prob=norm_topk_prob)
    llm = LLM(str(folder), dtype="float32", device="cpu")
    assert llm.runtime.model.config.moe.norm_topk_prob is norm_topk_prob
    assert type(llm.runtime.model).__name__ == "LlamaForCausalLM"
    assert _generate(llm) == expected


def test_olmoe_with_clip_qkv_takes_the_transformers_path(tmp_path):
    """clip_qkv (q, k and v clamped) is not in our layers: transformers' code serves it."""
    clipped, expected = save_clear_model(tmp_path / "clip", "olmoe", clip_qkv=0.5)
    llm = LLM(str(clipped), dtype="float32", device="cpu")
    assert type(llm.runtime.model).__name__ == "TransformersCausalLM"
    assert _generate(llm) == expected


FEATURES = ["gemma2", "gemma3_text", "gpt_oss", "deepseek_v3", "qwen2_moe", "phi3"]


@pytest.mark.parametrize("arch", FEATURES)
def test_engine_features_hold_beyond_the_llama_family(tmp_path, arch):
    """Chunked prefill (8-token budget), prefix caching (shared prompt starts), n-gram
    speculation and preemption (a KV cache of a few blocks) on layers with a sliding window
    of 8 (gemma2 soft-capped too), sinks, MLA and MoE, native or on transformers' code: the same
    greedy tokens."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 5, 6, 7], [5, 6, 7, 8, 9, 20, 21]]
    folder, expected = save_clear_model(tmp_path, arch, prompts, max_new_tokens=12)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    block = LLM(str(folder), dtype="float32", device="cpu", block_size=4).engine.runner
    llm = LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=8,
        block_size=4,
        kv_cache_memory=9 * block.bytes_per_block,  # the two rows need 12 blocks at the end
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    assert _generate(llm, prompts, params) == expected
    assert llm.engine.scheduler.num_preemptions > 0


WINDOWS = {  # per architecture: its window settings, and the layers that slide (transformers')
    "qwen2": (dict(use_sliding_window=True, max_window_layers=1), (None, 8)),
    "qwen3": (dict(use_sliding_window=True, layer_types=["sliding_attention", "full_attention"]),
              (8, None)),
    "qwen2_moe": (dict(use_sliding_window=True, max_window_layers=2), (8, None)),  # even layers
    "qwen3_moe": (dict(use_sliding_window=True), (8, 8)),  # every layer
}  # fmt: skip


@pytest.mark.parametrize("arch", WINDOWS)
def test_qwen_sliding_window_layers_are_native(tmp_path, arch):
    """Qwen's rules for which layers slide (`use_sliding_window`, `max_window_layers`,
    `layer_types`), on our own code: prompts and generations longer than the window of 8, with
    chunked prefill and prefix caching, give transformers' greedy tokens; with
    use_sliding_window off, no layer slides."""
    settings, windows = WINDOWS[arch]
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 5, 6, 7], [5, 6, 7, 8, 9, 20, 21]]
    folder, expected = save_clear_model(
        tmp_path, arch, prompts, max_new_tokens=12, sliding_window=8, **settings
    )
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(str(folder), dtype="float32", device="cpu", max_num_batched_tokens=8, block_size=4)
    assert type(llm.runtime.model).__name__ == "LlamaForCausalLM"
    assert llm.runtime.model.config.layer_windows == windows
    assert _generate(llm, prompts, params) == expected
    # (transformers itself fails on explicit sliding `layer_types` without a window)
    off = {k: v for k, v in settings.items() if k != "layer_types"}
    off["use_sliding_window"] = False
    folder, _ = save_clear_model(tmp_path / "off", arch, sliding_window=8, **off)
    assert not LLM(str(folder), device="cpu").runtime.model.config.layer_windows


def test_model_impl_transformers_serves_a_native_family_too(tmp_path):
    folder, expected = save_clear_model(tmp_path, "llama")
    llm = LLM(str(folder), dtype="float32", device="cpu", model_impl="transformers")
    assert type(llm.runtime.model).__name__ == "TransformersCausalLM"
    assert _generate(llm) == expected


def test_what_the_transformers_path_cannot_do_is_one_line(tmp_path):
    folder, _ = save_clear_model(tmp_path / "phi", "phi")
    with pytest.raises(ModelLoadError, match="--model-impl llmctl: .phi. is not native"):
        LLM(str(folder), device="cpu", model_impl="llmctl")
    with pytest.raises(UsageError, match="--batch-invariant needs llmctl's own model code"):
        LLM(str(folder), device="cpu", batch_invariant=True)
    with pytest.raises(UsageError, match="--model-impl"):
        LLM(str(folder), device="cpu", model_impl="vllm")
    gemma2, _ = save_clear_model(tmp_path / "gemma2", "gemma2")  # native, sliding windows
    with pytest.raises(UsageError, match="--batch-invariant is not available for gemma2"):
        LLM(str(gemma2), device="cpu", batch_invariant=True)


def test_an_architecture_transformers_does_not_know_is_refused(tmp_path):
    """A model whose code would come from its own folder (`auto_map`) is never run."""
    config = {"model_type": "my_remote_arch", "auto_map": {"AutoModelForCausalLM": "m.Model"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "m.py").write_text("raise SystemExit('code from the model folder ran')\n")
    with pytest.raises(ModelLoadError, match="unknown architecture 'my_remote_arch'"):
        LLM(str(tmp_path), device="cpu")
