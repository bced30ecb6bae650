"""The Hugging Face config of a llama.cpp GGUF file: transformers' GGUF reader, completed.

Owns `field` (one metadata value of a `gguf.GGUFReader`), `arch_metadata` (the scalar
`<arch>.*` keys of a file) and `hf_config` (the config a converted folder gets).

transformers' reader (`AutoConfig.from_pretrained(gguf_file=...)`, whose key table is
`GGUF_CONFIG_MAPPING` in transformers/integrations/ggml.py) leaves out some keys llama.cpp's
convert_hf_to_gguf.py writes, and llama.cpp derives some settings instead of storing them; a
config from that reader alone builds the wrong model for several families (a Qwen MoE with
transformers' default expert width, a Gemma 2 without soft-capping, a GPT-2 with 1024
positions). `hf_config` takes transformers' config and adds, from the file's own metadata:
  - EXTRA_KEYS: keys llama.cpp writes that transformers does not read, per family;
  - rope: `rope.freq_base` for every family (starcoder2's and stablelm's mappings lack it),
    partial rotary (`rope.dimension_count` below the head width: stablelm, phi3) and linear
    rope scaling (gemma3); any other scaling type is a one-line error;
  - Gemma's query scale, which llama.cpp never stores: it scales queries by 1/sqrt(head_dim),
    or by 1/sqrt(hidden/heads) for the 27B models it recognizes by their layer count
    (llama-model.cpp, `f_attention_scale`), so `query_pre_attn_scalar` is set the same way;
  - Mistral without a sliding window: llama.cpp writes Mistral as `llama` and attends over the
    whole context, as the GGUF's author ran it;
  - Falcon's block layout (new decoder architecture, norms per block, multi-query), which
    llama.cpp reads off the tensors present.
The config is rebuilt through its class (`AutoConfig.for_model`) so that transformers 5 folds
the rope keys into `rope_parameters` as it does for a config.json.
"""

from __future__ import annotations

from pathlib import Path

from llmctl.errors import ModelLoadError

# GGUF key after "<arch>." -> Hugging Face config attribute, where transformers' GGUF reader
# (5.25) does not read a key convert_hf_to_gguf.py writes (Qwen2MoeModel / Qwen3MoeModel,
# Gemma2Model, Phi3MiniModel, GPT2Model .set_gguf_parameters)
EXTRA_KEYS = {
    "qwen2moe": {
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    },
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "gemma2": {
        "attn_logit_softcapping": "attn_logit_softcapping",
        "final_logit_softcapping": "final_logit_softcapping",
    },
    "phi3": {"attention.sliding_window": "sliding_window"},
    "gemma3": {"rope.freq_base_swa": "rope_local_base_freq"},
    "gpt2": {"context_length": "n_positions", "feed_forward_length": "n_inner"},
    "falcon": {
        "attention.head_count_kv": "num_kv_heads",
        "attention.layer_norm_epsilon": "layer_norm_epsilon",
        "feed_forward_length": "ffn_hidden_size",
    },
}
PARTIAL_ROTARY = ("stablelm", "phi3")  # rope.dimension_count = partial_rotary_factor * head_dim
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def field(reader, key: str, default=None):
    """The value of metadata `key`; `default`, or a one-line error when it is None, if absent."""
    found = reader.fields.get(key)
    if found is None:
        if default is None:
            raise ModelLoadError(f"the GGUF file has no {key!r} metadata")
        return default
    if hasattr(found, "contents"):
        return found.contents()
    value = found.parts[found.data[0]]  # gguf < 0.11 has no contents(): one scalar or string
    return bytes(value).decode() if found.types[0].name == "STRING" else value[0]


def arch_metadata(reader, arch: str) -> dict:
    """The file's scalar `<arch>.*` metadata, keyed without the prefix."""
    prefix = f"{arch}."
    out = {}
    for key, found in reader.fields.items():
        if key.startswith(prefix) and len(found.data) == 1 and found.types[0].name != "ARRAY":
            out[key[len(prefix) :]] = field(reader, key)
    return out


def first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else "no detail"


def hf_config(file: Path, arch: str, meta: dict, tensor_names: set[str]):
    """transformers' config for `file`, completed from `meta` and the names of its tensors
    (see the module docstring); tied embeddings where the file has no output tensor."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as e:
        raise ModelLoadError(
            f"{file.name}: transformers cannot read this GGUF's config ({type(e).__name__}: "
            f"{first_line(e)})"
        ) from None
    values = config.to_dict()
    model_type = values.pop("model_type")
    for key in ("rope_parameters", "rope_scaling"):  # rebuilt from the file's rope keys
        values.pop(key, None)
    extra = EXTRA_KEYS.get(arch, {})
    values.update({attr: meta[key] for key, attr in extra.items() if key in meta})
    values.update(_rope(file, arch, meta, values))
    if arch in GEMMA_27B_LAYERS:
        big = values["num_hidden_layers"] == GEMMA_27B_LAYERS[arch]
        heads = values["num_attention_heads"]
        values["query_pre_attn_scalar"] = (
            values["hidden_size"] // heads if big else values.get("head_dim") or 256
        )
    if model_type == "mistral":
        values["sliding_window"] = None
    if arch == "falcon":
        values.update(_falcon_layout(values, tensor_names))
    values["tie_word_embeddings"] = "output.weight" not in tensor_names
    return AutoConfig.for_model(model_type, **values)


def _falcon_layout(values: dict, tensor_names: set[str]) -> dict:
    """Falcon's block layout, which llama.cpp reads off the tensors rather than the metadata:
    two norms per block (attn_norm_2: Falcon-40B/180B) or grouped keys/values (Falcon2) mean
    the "new decoder architecture"; without it, Falcon-7B's one key/value head (multi-query)."""
    two_norms = "blk.0.attn_norm_2.weight" in tensor_names
    kv_heads = values.get("num_kv_heads", 1)
    return {
        "new_decoder_architecture": two_norms or kv_heads > 1,
        "num_ln_in_parallel_attn": 2 if two_norms else 1,
        "multi_query": True,  # read only without the new architecture: Falcon-7B's one k/v head
        "parallel_attn": True,
        "alibi": False,
        "bias": False,
    }


def _rope(file: Path, arch: str, meta: dict, values: dict) -> dict:
    out = {}
    if "rope.freq_base" in meta:
        out["rope_theta"] = float(meta["rope.freq_base"])
    if arch in PARTIAL_ROTARY and "rope.dimension_count" in meta:
        head_dim = values["hidden_size"] // values["num_attention_heads"]
        out["partial_rotary_factor"] = int(meta["rope.dimension_count"]) / head_dim
    kind = meta.get("rope.scaling.type", "none")
    if kind == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(meta["rope.scaling.factor"])}
    elif kind != "none":
        raise ModelLoadError(
            f"{file.name}: rope scaling {kind!r} in a GGUF file is not converted; convert the "
            "original Hugging Face folder instead"
        )
    return out
