"""llama.cpp GGUF tensors as Hugging Face tensors: their names, layouts and values.

Owns `name_table` (GGUF tensor name -> the Hugging Face checkpoint names and shapes it holds)
and `read_tensors` (the file's tensors under those names, dequantized).

Names come from gguf-py's `TensorNameMap`, the table llama.cpp's convert_hf_to_gguf.py renames
with, inverted against the Hugging Face model's own names: the model is built from the
converted config on the meta device (no memory), each of its checkpoint names is mapped to its
GGUF name, and the file is read back through that inverse, so a family needs no hand table.
MoE experts, which the converter stacks into one [E, out, in] tensor per projection
(`Qwen2MoeModel.modify_tensors`: ffn_gate_exps, ffn_up_exps, ffn_down_exps), are looked up
without their index and split back into `experts.<e>.<proj>.weight`, the checkpoint format
(transformers 5 fuses them in memory as `experts.gate_up_proj` [E, 2I, H] and `down_proj`
[E, H, I], and writes them back per expert on save).

What the converter changed besides names is undone per family (FIXUPS):
  - llama (mistral too): q/k rows permuted for llama.cpp's rotary layout
    (`LlamaModel.permute`);
  - gemma2, gemma3: every RMSNorm weight stored as weight + 1, since Gemma's norm multiplies
    by 1 + weight (`Gemma2Model.modify_tensors`, `Gemma3Model.modify_tensors`);
  - gpt2: Conv1D weights ([in, out]) stored transposed (`GPT2Model.modify_tensors`);
  - falcon: fused qkv rows regrouped from per key/value group to q, k, v
    (`FalconModel.modify_tensors`).
A tensor that differs from its Hugging Face shape only by axes of size 1 is reshaped to it
(Qwen2-MoE's shared-expert gate is [H] in some files, [1, H] in the model); any other shape
difference is a one-line error naming the tensor, as is a tensor the model has no place for.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmctl.errors import ModelLoadError
from llmctl.runtime.gguf_config import first_line

EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")
FUSED_EXPERTS = re.compile(r"(.+\.experts)\.(gate_up_proj|down_proj)")
# tensors that carry rope scaling llama.cpp's way, whose parameters the file does not keep
ROPE_TENSORS = {
    "rope_freqs.weight": "rope_freqs (Llama 3.1-style rope scaling)",
    "rope_factors_long.weight": "rope_factors_long (Phi-3 long-context rope scaling)",
    "rope_factors_short.weight": "rope_factors_short (Phi-3 long-context rope scaling)",
}


def name_table(config, arch: str) -> tuple[dict[str, list[tuple[str, tuple]]], str]:
    """GGUF name -> [(Hugging Face name, shape)] (one per expert for stacked experts), and the
    transformers class name of the model `config` builds."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model_arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    table: dict[str, list[tuple[str, tuple]]] = {}
    for hf, shape in _checkpoint_shapes(model).items():
        base, _, suffix = hf.rpartition(".")
        found = names.get_name(EXPERT_INDEX.sub(".experts.", base))
        if found is not None:
            table.setdefault(f"{found}.{suffix}", []).append((hf, shape))
    return table, type(model).__name__


def _checkpoint_shapes(model) -> dict[str, tuple]:
    """The model's tensors as a checkpoint names them: fused experts split per expert."""
    out = {}
    for name, t in model.state_dict().items():
        m = FUSED_EXPERTS.fullmatch(name)
        if m is None or t.dim() != 3:
            out[name] = tuple(t.shape)
            continue
        n_experts, rows, cols = t.shape
        if m.group(2) == "down_proj":
            parts = [("down_proj", (rows, cols))]
        else:  # [E, 2I, H]: gate rows first, then up
            parts = [("gate_proj", (rows // 2, cols)), ("up_proj", (rows // 2, cols))]
        for e in range(n_experts):
            for proj, shape in parts:
                out[f"{m.group(1)}.{e}.{proj}.weight"] = shape
    return out


def read_tensors(reader, file: Path, arch: str, config, table: dict, dtype) -> dict:
    """Hugging Face name -> tensor in `dtype`, dequantizing one tensor at a time so that peak
    memory is the converted model plus one float32 tensor."""
    import numpy as np
    import torch

    fixup = FIXUPS.get(arch)
    tensors = {}
    for t in reader.tensors:
        targets = table.get(t.name)
        if targets is None:
            raise ModelLoadError(f"{file.name}: {_unmapped(t.name, arch)}")
        w = _dequantize(t, file)
        if fixup is not None:
            w = fixup(t.name, w, config)
        parts = [w] if len(targets) == 1 else _split_experts(w, t.name, len(targets), file)
        for (name, shape), part in zip(targets, parts):
            part = np.ascontiguousarray(_to_shape(part, shape, t.name, file), dtype=np.float32)
            if not part.flags.writeable:  # a float32 tensor read straight from the mapped file
                part = part.copy()
            tensors[name] = torch.from_numpy(part).to(dtype)
    return tensors


def missing_tensors(table: dict, tensors: dict, tied: bool) -> list[str]:
    """The model's checkpoint names the file gave no tensor for (lm_head when tied)."""
    expected = {name for targets in table.values() for name, _ in targets}
    return sorted(n for n in expected - tensors.keys() if not (tied and n == "lm_head.weight"))


def _unmapped(name: str, arch: str) -> str:
    if name in ROPE_TENSORS:
        return (
            f"carries {ROPE_TENSORS[name]}, which the GGUF conversion does not map; convert "
            "the original Hugging Face folder instead"
        )
    return f"unexpected GGUF tensor {name!r} for architecture {arch!r}"


def _dequantize(t, file: Path):
    from gguf import dequantize

    try:
        return dequantize(t.data, t.tensor_type)
    except Exception as e:  # data cut short, unknown quantization type
        raise ModelLoadError(
            f"{file.name}: tensor {t.name} cannot be read ({type(e).__name__}: {first_line(e)})"
        ) from None


def _split_experts(w, name: str, n_experts: int, file: Path) -> list:
    if w.ndim != 3 or w.shape[0] != n_experts:
        raise ModelLoadError(
            f"{file.name}: tensor {name} has shape {list(w.shape)}, not {n_experts} stacked experts"
        )
    return list(w)


def _to_shape(w, shape: tuple, name: str, file: Path):
    """`w` as `shape` where they differ only by axes of size 1 ([H] for [1, H])."""
    if tuple(w.shape) == shape:
        return w
    if [d for d in w.shape if d != 1] == [d for d in shape if d != 1]:
        return w.reshape(shape)
    raise ModelLoadError(
        f"{file.name}: tensor {name} has shape {list(w.shape)} where the file's config makes "
        f"{list(shape)}"
    )


def _unpermute_qk(name: str, w, config):
    """Undo convert_hf_to_gguf's LlamaModel.permute of q/k rows (rotary pairs interleaved),
    weights and biases alike."""
    if not name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
        return w
    heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
    pairs = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:])
    return pairs.swapaxes(1, 2).reshape(w.shape)


def _unshift_norms(name: str, w, config):
    """Gemma's norms multiply by 1 + weight; llama.cpp stores weight + 1."""
    return w - 1 if name.endswith("norm.weight") else w


def _untranspose_conv1d(name: str, w, config):
    """GPT-2's Conv1D weights are [in, out]; llama.cpp stores them as [out, in]."""
    conv1d = ("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight")
    return w.T if name.endswith(conv1d) else w


def _ungroup_falcon_qkv(name: str, w, config):
    """Falcon's fused qkv rows are per key/value group: each group's query heads, then its key
    and its value head; llama.cpp stores all queries, then all keys, then all values
    (FalconModel.modify_tensors). An identity for one key/value head (Falcon-7B)."""
    import numpy as np

    if not name.endswith(("attn_qkv.weight", "attn_qkv.bias")):
        return w
    heads, groups = config.num_attention_heads, config.num_kv_heads
    head_dim = config.hidden_size // heads
    q_rows, kv_rows = heads * head_dim, groups * head_dim
    q = w[:q_rows].reshape(groups, heads // groups, head_dim, *w.shape[1:])
    k = w[q_rows : q_rows + kv_rows].reshape(groups, 1, head_dim, *w.shape[1:])
    v = w[q_rows + kv_rows :].reshape(groups, 1, head_dim, *w.shape[1:])
    return np.concatenate([q, k, v], axis=1).reshape(w.shape)


FIXUPS = {
    "llama": _unpermute_qk,
    "gemma2": _unshift_norms,
    "gemma3": _unshift_norms,
    "gpt2": _untranspose_conv1d,
    "falcon": _ungroup_falcon_qkv,
}
