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
`llmctl[gguf]`), one tensor at a time, and kept in the file's float dtype (float32, float16 or
bfloat16), or bfloat16 when any matrix is quantized. gguf_tensors.py names them (gguf-py's
TensorNameMap inverted against the model the config builds) and undoes what llama.cpp's
converter changed per family; gguf_config.py takes the config from transformers' GGUF reader
(`AutoConfig` with `gguf_file=`, public API since transformers 4.41) and completes it from the
file's metadata; the tokenizer (with the chat template) is transformers' `AutoTokenizer` with
`gguf_file=`. Converted: ARCHITECTURES, the decoder families of transformers' GGUF reader that
llmctl runs (llama with mistral, qwen2, qwen3, their MoE forms, gemma2, gemma3's text model,
phi3, starcoder2, stablelm, gpt2, falcon). Not converted (one-line errors naming them): other
architectures (bloom, mamba, nemotron, lfm2, deci, gpt-oss, minimax-m2, gemma4 among
transformers' own, and llama with experts, i.e. Mixtral), rope scaling other than linear, and
files carrying `rope_freqs` or `rope_factors_*` (llama.cpp's forms of Llama 3.1 and Phi-3
long-context rope scaling, whose parameters the file does not keep).

Why not transformers' `AutoModelForCausalLM.from_pretrained(gguf_file=...)` for the weights too
(what ../shared/tools/real_model.py does), measured on SmolLM2-135M-Instruct Q4_1 (98 MB file,
2-core AMD EPYC, BENCHMARKS.md "GGUF files as MODEL"): 25.0 s and 915 MB peak RSS there, 12.4 s
and 763 MB here for the first, llama-only version; the generic names (a meta-device model, the
file's metadata read twice) made it 17 s and 1010 MB (G36b), still bit-identical weights and the
same tokenizer and config. It also needs
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
from llmctl.runtime.gguf_config import arch_metadata, field, first_line, hf_config
from llmctl.runtime.gguf_tensors import missing_tensors, name_table, read_tensors

FORMAT = 2  # bump when the converted folder's contents change: older cache entries are then unused
HEAD_BYTES = 1 << 20
INSTALL_HINT = "pip install 'llmctl[gguf]'"
# general.architecture values converted (llama.cpp writes mistral as llama)
ARCHITECTURES = (
    "llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3", "phi3",
    "starcoder2", "stablelm", "gpt2", "falcon",
)  # fmt: skip


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
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{file.name}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)} (llama covers mistral)"
        )
    meta = arch_metadata(reader, arch)
    if arch == "llama" and "expert_count" in meta:
        raise ModelLoadError(f"{file.name}: GGUF llama with experts (Mixtral) is not supported")
    names = {t.name for t in reader.tensors}
    dtype = _target_dtype(reader)
    del reader  # transformers reads the metadata again below: do not hold two copies
    config = hf_config(file, arch, meta, names)
    table, hf_class = name_table(config, arch)
    tensors = read_tensors(_open(file), file, arch, config, table, dtype)
    missing = missing_tensors(table, tensors, config.tie_word_embeddings)
    if missing:
        raise ModelLoadError(
            f"{file.name}: the GGUF file has no tensor for {len(missing)} weights of its "
            f"{hf_class} ({', '.join(missing[:3])}...)"
        )
    _save_safetensors(tensors, out / "model.safetensors")
    del tensors
    config.architectures = [hf_class]
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


def _target_dtype(reader):
    """The float dtype of the matrices when they share one, else bfloat16 (quantized)."""
    import torch
    from gguf import GGMLQuantizationType as Q

    kinds = {t.tensor_type for t in reader.tensors if len(t.shape) > 1}
    floats = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
    if len(kinds) == 1 and next(iter(kinds)) in floats:
        return floats[next(iter(kinds))]
    return torch.bfloat16


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


def _hf_tokenizer(file: Path):
    """transformers' GGUF tokenizer reader (with the chat template); a failure is one line."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as e:
        raise ModelLoadError(
            f"{file.name}: transformers cannot read this GGUF's tokenizer ({type(e).__name__}: "
            f"{first_line(e)})"
        ) from None
