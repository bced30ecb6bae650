"""Tiny random models (two layers, hidden 64) of 25 decoder architectures that transformers
builds, for the tests of every command on every model (issue 36).

`build(arch, seed)` returns the transformers model in eval mode; `save_clear_model` saves one
whose greedy choices on the test prompts all have a clear margin over the runner-up (so an
exact comparison cannot flip on rounding), trying seeds in turn.
"""

from __future__ import annotations

from pathlib import Path

import pytest

COMMON = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# per architecture: what differs from COMMON (None: drop the key)
EXTRA = {
    "mistral": dict(sliding_window=None),
    "gemma2": dict(sliding_window=8, query_pre_attn_scalar=16),
    "gemma3_text": dict(sliding_window=8, query_pre_attn_scalar=16),
    "qwen2_moe": dict(MOE, shared_expert_intermediate_size=48, decoder_sparse_step=1),
    "qwen3_moe": dict(MOE, decoder_sparse_step=1),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "deepseek_v3": dict(  # MLA (keys 24 wide, values 16) and MoE after one dense layer
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_key_value_heads=4,
        head_dim=8,
    ),
    "phi": dict(partial_rotary_factor=0.5, num_key_value_heads=4),
    "stablelm": dict(num_key_value_heads=4),
    "gpt_neox": dict(num_key_value_heads=4),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, head_dim=None),
    "starcoder2": dict(sliding_window=None),
}
NATIVE = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe",
    "gemma", "gemma2", "gemma3_text",
)  # fmt: skip
MOE_ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3")
ARCHS = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi",
    "phi3",
    *MOE_ARCHS,
    "olmo2",
    "granite",
    "starcoder2",
    "cohere",
    "stablelm",
    "gpt_neox",
    "gpt2",
    "falcon",
    "glm4",
    "smollm3",
)
PROMPTS = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [12, 13, 14])


def build(arch: str, seed: int = 0, **overrides):
    import torch
    import transformers

    kw = {**COMMON, "initializer_range": 0.3, **EXTRA.get(arch, {}), **overrides}
    config = transformers.AutoConfig.for_model(
        arch, **{k: v for k, v in kw.items() if v is not None}
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def greedy(model, prompts=PROMPTS, max_new_tokens: int = 8) -> tuple[list[list[int]], float]:
    """transformers' greedy tokens for each prompt, and the smallest top-1/top-2 logit gap."""
    import torch

    tokens, gap = [], float("inf")
    for p in prompts:
        out = model.generate(
            torch.tensor([p]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        tokens.append(out.sequences[0, len(p) :].tolist())
        for scores in out.scores:
            top = scores[0].float().topk(2).values
            gap = min(gap, float(top[0] - top[1]))
    return tokens, gap


def save_clear_model(folder: Path, arch: str, prompts=PROMPTS, max_new_tokens: int = 8, **kw):
    """Save the first seed's model whose greedy choices all have a margin of 1e-3 or more; return
    (folder, transformers' greedy tokens)."""
    for seed in range(20):
        model = build(arch, seed, **kw)
        tokens, gap = greedy(model, prompts, max_new_tokens)
        if gap > 1e-3:
            model.save_pretrained(folder)
            return folder, tokens
    raise AssertionError(f"no seed of {arch} gives clear greedy margins")


WORDS = 150  # the word-level tokenizer's words w0..w149 (ids 3..152, after <unk>, <s>, </s>)


def save_word_tokenizer(folder: Path) -> None:
    """A word-level tokenizer (each w<i> one token) into `folder`, for tests whose commands read
    text (calibration, eval) on the tiny models."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)


def write_words(path: Path, lines: int = 16, words: int = 40) -> Path:
    """A text file of random words w0..w149 (seeded), one token each with save_word_tokenizer's."""
    import random

    rnd = random.Random(0)
    text = (" ".join(f"w{rnd.randrange(WORDS)}" for _ in range(words)) for _ in range(lines))
    path.write_text("\n".join(text) + "\n")
    return path


@pytest.fixture(autouse=True)
def one_thread():
    """Autouse where imported: the test runs at one thread (the compress tests' sums in one
    order, and no oversubscription beside other jobs)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
