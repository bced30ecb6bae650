"""llama.cpp GGUF files as models: a `.gguf` converted once into a Hugging Face folder in the cache.

Owns: `find_gguf` (is MODEL a `.gguf` file, or a folder holding exactly one and no config.json?)
and `gguf_folder` (the converted folder for one, converting it on first use). resolve.py calls
both, so every command takes a GGUF wherever it takes a folder.

The folder (config.json, model.safetensors, tokenizer files, chat template) lives under
`cache_root()/gguf/`, keyed by the file's size, mtime and a hash of its first MiB: a second run
finds it without reading the weights again, and an edited file gets a new folder. It is written
in a temporary folder and renamed into place, so an interrupted conversion leaves nothing that
a later run could mistake for a finished one. The user's file is only read.

Weights are dequantized with the `gguf` package (llama.cpp's own reader, the optional extra
`llmctl[gguf]`), one tensor at a time, renamed to Hugging Face names here (q/k un-permuted for
llama, as llama.cpp's converter permuted them) and kept in the file's float dtype (float32,
float16 or bfloat16), or bfloat16 when any matrix is quantized. Config and tokenizer (with the
chat template) come from transformers' GGUF readers (`AutoConfig` / `AutoTokenizer` with
`gguf_file=`), public API since transformers 4.41. Not converted (one-line errors): other
architectures than llama (mistral included), qwen2 and qwen3, and files carrying `rope_freqs`
(llama.cpp's form of Llama 3.1 rope scaling, whose parameters the file does not keep).

Why not transformers' `AutoModelForCausalLM.from_pretrained(gguf_file=...)` for the weights too
(what ../shared/tools/real_model.py does), measured on SmolLM2-135M-Instruct Q4_1 (98 MB file,
2-core AMD EPYC, BENCHMARKS.md "GGUF files as MODEL"): 25.0 s and 915 MB peak RSS there, 12.4 s
and 763 MB here, for bit-identical weights and the same tokenizer and config. It also needs
`accelerate` (not an llmctl dependency), and transformers 5 keeps quantized weights packed behind
an `hf_quantizer` that must be stripped before saving: an internal detail that has changed
between releases (llmctl supports transformers >= 4.45).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from llmctl.cache_dir import cache_root
from llmctl.errors import ModelLoadError

FORMAT = 1  # bump when the converted folder's contents change: older cache entries are then unused
HEAD_BYTES = 1 << 20
INSTALL_HINT = "pip install 'llmctl[gguf]'"
# general.architecture values llmctl serves (llama.cpp writes mistral as llama)
ARCHITECTURES = ("llama", "qwen2", "qwen3")
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
HF_CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def find_gguf(path: Path) -> Path | None:
    """The GGUF file MODEL names: itself when it is a `.gguf` file, the one `.gguf` inside a
    folder without config.json; None when MODEL is no GGUF."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4])
        raise ModelLoadError(f"{path} holds {len(found)} .gguf files ({names}...); pass one file")
    return found[0] if found else None


def gguf_folder(file: Path) -> Path:
    """The Hugging Face folder converted from `file`, from the cache or converted now."""
    _require_gguf()
    key = _cache_key(file)
    root = cache_root() / "gguf"
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", file.stem)[:80]
    out = root / f"{stem}-{key}"
    if (out / "config.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=root))
    try:
        _convert(file, tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished the same conversion first: use its folder
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelLoadError(
            f"reading a .gguf model needs the gguf package: {INSTALL_HINT}"
        ) from None


def _cache_key(file: Path) -> str:
    st = file.stat()
    h = hashlib.sha256(f"{FORMAT}:{st.st_size}:{st.st_mtime_ns}:".encode())
    with open(file, "rb") as f:
        h.update(f.read(HEAD_BYTES))
    return h.hexdigest()[:20]


def _convert(file: Path, out: Path) -> None:
    reader = _open(file)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{file.name}: GGUF architecture {arch!r} is not supported; supported: llama "
            "(also mistral), qwen2, qwen3"
        )
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    dtype = _target_dtype(reader)
    tensors = _read_tensors(reader, file, arch, heads, kv_heads, dtype)
    tied = "lm_head.weight" not in tensors
    _save_safetensors(tensors, out / "model.safetensors")
    del tensors, reader  # transformers reads the metadata again below: do not hold two copies
    config = _hf_config(file)
    config.tie_word_embeddings = tied
    config.architectures = [f"{HF_CLASSES.get(config.model_type, 'Llama')}ForCausalLM"]
    config.torch_dtype = dtype  # transformers 5 saves it as "dtype", 4.x as "torch_dtype"
    config.save_pretrained(out)
    _hf_tokenizer(file).save_pretrained(out)


def _open(file: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(file, "r")
    except Exception as e:  # numpy's words for a short read say nothing to the user
        raise ModelLoadError(
            f"{file} is not a readable GGUF file (truncated or corrupt: {type(e).__name__})"
        ) from None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ModelLoadError(f"the GGUF file has no {key!r} metadata")
        return default
    if hasattr(field, "contents"):
        return field.contents()
    value = field.parts[field.data[0]]  # gguf < 0.11 has no contents(): one scalar or string
    return bytes(value).decode() if field.types[0].name == "STRING" else value[0]


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else "no detail"


def _target_dtype(reader):
    """The float dtype of the matrices when they share one, else bfloat16 (quantized)."""
    import torch
    from gguf import GGMLQuantizationType as Q

    kinds = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    floats = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
    if len(kinds) == 1 and next(iter(kinds)) in floats:
        return floats[next(iter(kinds))]
    return torch.bfloat16


def _read_tensors(reader, file: Path, arch: str, heads: int, kv_heads: int, dtype) -> dict:
    """Hugging Face name -> tensor in `dtype`, dequantizing one tensor at a time so that peak
    memory is the converted model plus one float32 tensor."""
    import numpy as np
    import torch
    from gguf import dequantize

    tensors = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise ModelLoadError(
                f"{file.name} carries rope_freqs (Llama 3.1-style rope scaling), which the GGUF "
                "conversion does not map yet; convert the original Hugging Face folder instead"
            )
        name = _hf_name(t.name, file)
        try:
            w = dequantize(t.data, t.tensor_type)
        except Exception as e:  # data cut short, unknown quantization type
            raise ModelLoadError(
                f"{file.name}: tensor {t.name} cannot be read ({type(e).__name__}: "
                f"{_first_line(e)})"
            ) from None
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _unpermute(w, heads if "q_proj" in name else kv_heads)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if not w.flags.writeable:  # a float32 tensor read straight from the memory-mapped file
            w = w.copy()
        tensors[name] = torch.from_numpy(w).to(dtype)
    return tensors


def _save_safetensors(tensors: dict, path: Path) -> None:
    """safetensors' file layout written one tensor at a time: `safetensors.torch.save_file`
    first builds the whole file in memory, which doubled the conversion's peak."""
    import json
    import struct

    import torch

    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": names[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensors.values():
            f.write(t.contiguous().view(torch.uint8).numpy().data)


def _hf_name(name: str, file: Path) -> str:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = LAYER_RE.fullmatch(name)
    if m and m.group(2) in LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    raise ModelLoadError(f"{file.name}: unexpected GGUF tensor {name!r} for this architecture")


def _unpermute(w, n_head: int):
    """Undo llama.cpp's convert_hf_to_gguf permute of q/k rows (rotary pairs interleaved)."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _hf_config(file: Path):
    from transformers import AutoConfig

    return _read_with(AutoConfig, file, "config")


def _hf_tokenizer(file: Path):
    from transformers import AutoTokenizer

    return _read_with(AutoTokenizer, file, "tokenizer")


def _read_with(auto, file: Path, what: str):
    """transformers' `auto.from_pretrained` of the GGUF's `what`; a failure is one line."""
    try:
        return auto.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as e:
        raise ModelLoadError(
            f"{file.name}: transformers cannot read this GGUF's {what} ({type(e).__name__}: "
            f"{_first_line(e)})"
        ) from None
