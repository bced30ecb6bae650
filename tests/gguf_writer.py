"""A Hugging Face folder written as llama.cpp's convert_hf_to_gguf.py would write it, for the
GGUF tests: gguf-py's GGUFWriter with the converter's names (gguf-py's TensorNameMap, which the
converter's `map_tensor_name` uses), its tensor changes and the metadata keys its
`set_gguf_parameters` writes, family by family (the function each step follows is named
beside it; checked against ggml-org/llama.cpp's convert_hf_to_gguf.py).

`write_gguf(folder, path, quantize=False, extra=None)`: float32 tensors, or Q8_0 for every
matrix whose rows are whole Q8_0 blocks when `quantize`; `extra(writer)` adds metadata.
`add_tokenizer(writer, folder)`: a tokenizer.json BPE vocabulary (and chat template) as the
converter's `_set_vocab_gpt2` stores one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

# transformers model_type -> general.architecture (MistralForCausalLM is registered on
# LlamaModel, so Mistral is written as llama)
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "starcoder2": "starcoder2",
    "stablelm": "stablelm",
    "gpt2": "gpt2",
    "falcon": "falcon",
}
EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)\.weight")


def add_tokenizer(w, folder: Path) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    special = {t["id"] for t in tok["added_tokens"]}
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_pad_token_id(1)
    w.add_add_bos_token(False)
    w.add_chat_template(tcfg["chat_template"])


def _common(w, c: dict) -> None:
    """TextModel.set_gguf_parameters: the keys every family gets from config.json."""
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c.get("num_key_value_heads", c["num_attention_heads"]))
    rope = c["rope_parameters"]
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])  # gemma3: per layer type
    if "rms_norm_eps" in c:
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    else:
        w.add_layer_norm_eps(c.get("layer_norm_eps", c.get("norm_epsilon")))
    w.add_vocab_size(c["vocab_size"])


def _params(w, arch: str, c: dict) -> None:
    """Each family's set_gguf_parameters beyond _common."""
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if arch == "gpt2":  # GPT2Model.set_gguf_parameters: its own keys only
        w.add_block_count(c["n_layer"])
        w.add_context_length(c["n_positions"])
        w.add_embedding_length(c["n_embd"])
        w.add_feed_forward_length(4 * c["n_embd"])
        w.add_head_count(c["n_head"])
        w.add_layer_norm_eps(c["layer_norm_epsilon"])
        return
    if arch == "falcon":  # FalconModel.set_gguf_parameters: its own keys only
        w.add_context_length(2048)  # "not in config.json"
        w.add_tensor_data_layout("jploski")
        w.add_embedding_length(c["hidden_size"])
        w.add_feed_forward_length(4 * c["hidden_size"])
        w.add_block_count(c["num_hidden_layers"])
        w.add_head_count(c["num_attention_heads"])
        w.add_head_count_kv(c["num_kv_heads"])
        w.add_layer_norm_eps(c["layer_norm_epsilon"])
        return
    _common(w, c)
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        w.add_rope_dimension_count(head_dim)
    if arch in ("qwen2moe", "qwen3moe"):  # Qwen2MoeModel / Qwen3MoeModel.set_gguf_parameters
        w.add_expert_count(c.get("num_experts", c.get("num_local_experts")))  # v5: local
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        if "shared_expert_intermediate_size" in c:
            w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if arch in ("qwen3moe", "gemma2", "gemma3"):  # head_dim as key/value length
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3"):  # Gemma2Model / Gemma3Model.set_gguf_parameters
        w.add_sliding_window(c["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters
        w.add_rope_dimension_count(head_dim)
        if c.get("sliding_window"):
            w.add_sliding_window(c["sliding_window"])
    if arch == "stablelm":  # StableLMModel.set_gguf_parameters
        factor = c.get("partial_rotary_factor") or c["rope_parameters"]["partial_rotary_factor"]
        w.add_rope_dimension_count(int(factor * head_dim))
        w.add_parallel_residual(c["use_parallel_residual"])


def _permute(w, n_head: int):
    # LlamaModel.permute: each head's rotary halves interleaved as pairs
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _group_qkv(a, c: dict):
    # FalconModel.modify_tensors: per key/value group [q heads, k, v] -> all q, all k, all v
    heads, groups = c["num_attention_heads"], c["num_kv_heads"]
    head_dim = c["hidden_size"] // heads
    qkv = a.reshape(groups, heads // groups + 2, head_dim, *a.shape[1:])
    q = qkv[:, :-2].reshape(heads * head_dim, *a.shape[1:])
    k = qkv[:, -2].reshape(groups * head_dim, *a.shape[1:])
    v = qkv[:, -1].reshape(groups * head_dim, *a.shape[1:])
    return np.concatenate([q, k, v]).reshape(a.shape)


def _tensors(arch: str, c: dict, weights: dict):
    """(HF name, array) as each family's modify_tensors yields them, experts stacked."""
    experts: dict[tuple[str, str], list] = {}
    for name, t in weights.items():
        a = t.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # LlamaModel.modify_tensors
            kv = c["num_key_value_heads"] if "k_proj" in name else c["num_attention_heads"]
            a = _permute(a, kv)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            a = a + 1  # Gemma2Model / Gemma3Model.modify_tensors: norms stored as 1 + weight
        if arch == "gpt2" and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            a = a.T  # GPT2Model.modify_tensors: Conv1D [in, out] -> [out, in]
        if arch == "falcon" and "query_key_value" in name:
            a = _group_qkv(a, c)
        m = EXPERT.fullmatch(name)
        if m:  # Qwen2MoeModel.modify_tensors: per-expert weights stacked, index dropped
            experts.setdefault((m.group(1), m.group(3)), []).append((int(m.group(2)), a))
            continue
        yield name, a
        if arch == "gpt2" and name == "transformer.wte.weight":
            yield "lm_head.weight", a  # GPT2Model.modify_tensors: output written as wte
    for (prefix, proj), parts in experts.items():
        yield f"{prefix}.{proj}.weight", np.stack([a for _, a in sorted(parts, key=lambda p: p[0])])


def write_gguf(folder: Path, path: Path, quantize: bool = False, extra=None) -> Path:
    """`folder` (a saved transformers model with the demo tokenizer) as a llama.cpp GGUF;
    `extra(writer)` adds metadata after the converter's."""
    import gguf
    from safetensors.torch import load_file

    c = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[c["model_type"]]
    model_arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    layers = c.get("num_hidden_layers", c.get("n_layer"))
    names = gguf.get_tensor_name_map(model_arch, layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {c['model_type']}")
    _params(w, arch, c)
    if extra is not None:
        extra(w)
    add_tokenizer(w, folder)
    for name, a in _tensors(arch, c, load_file(str(folder / "model.safetensors"))):
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        if quantize and a.ndim >= 2 and a.shape[-1] % 32 == 0:
            q = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(new, gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(new, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
