"""Memory and speed estimates from a model's config.json alone (no weights): pure arithmetic.

Owns: parameter and weight-byte counts per storage format (int4/int8 with their per-group scales and
zero points), KV-cache bytes per token / sequence / batch, how many sequences fit in a memory
budget, the bandwidth-bound decode ceiling and FLOPs per token (used for MFU), and finding a
config.json from a folder, a file or a hub id.

Conventions (stated in every estimate record):
- Quantized formats (int8, int4) quantize the decoder's linear weights (q/k/v/o, gate/up/down) in
  groups of `group_size` input elements per output row (None: one group per output row). Each group
  stores one 16-bit scale and one zero point packed at the weight's bit width (asymmetric, as AWQ
  and GPTQ checkpoints do). Embeddings, lm_head, norms and biases stay 16-bit unless
  `quantize_embeddings`.
- KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per KV element.
- A sequence's KV is rounded up to whole blocks of `block_size` tokens (the paged cache allocates
  blocks).
- Decode ceiling: each decode step reads every weight once plus the KV of every sequence in the
  batch, so steps/s <= bandwidth / (weight bytes + batch x context x KV bytes per token); each step
  yields one token per sequence (per-sequence tokens/s = steps/s, aggregate = batch x steps/s).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmctl.errors import ModelLoadError, UsageError
from llmctl.models.config import ModelConfig
from llmctl.profiling.arch_shapes import ArchShapes, arch_shapes
from llmctl.profiling.dtypes import canonical_dtype

# Weight storage formats and their bits per element.
WEIGHT_BITS = {"float32": 32, "bfloat16": 16, "float16": 16, "int8": 8, "int4": 4}
# KV-cache element formats and their bytes per element.
KV_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}
SCALE_BYTES = 2  # one 16-bit scale per group


def normalize_dtype(name: str, table: dict[str, Any], what: str) -> str:
    """'bf16' -> 'bfloat16' (see `dtypes`); raises UsageError for a name not in `table`."""
    key = canonical_dtype(name)
    if key not in table:
        raise UsageError(f"unknown {what} {name!r}; choose one of: {', '.join(table)}")
    return key


def linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of the 7 linear layers of one decoder layer (q, k, v, o, gate,
    up, down), as llmctl.models.layout.decoder_linears names them."""
    from llmctl.models.layout import LINEAR_NAMES, decoder_linears

    return [(o, i) for _, o, i in decoder_linears(config)[: len(LINEAR_NAMES)]]


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of a checkpoint by part; `total` is what must sit in device memory."""

    linear: int  # decoder linear weights (packed when quantized)
    scales: int  # per-group scales of quantized matrices
    zeros: int  # per-group zero points of quantized matrices
    embeddings: int  # embed_tokens + lm_head (lm_head counted once when tied)
    other: int  # norms and biases

    @property
    def total(self) -> int:
        return self.linear + self.scales + self.zeros + self.embeddings + self.other


def _matrix_bytes(
    out_f: int, in_f: int, bits: int, group_size: int | None, quantized: bool, float_bytes: int
) -> tuple[int, int, int]:
    """(weight, scales, zeros) bytes of one [out_f, in_f] matrix."""
    if not quantized:
        return out_f * in_f * float_bytes, 0, 0
    groups = out_f * (1 if group_size is None else math.ceil(in_f / group_size))
    return math.ceil(out_f * in_f * bits / 8), groups * SCALE_BYTES, math.ceil(groups * bits / 8)


def weight_bytes(
    config: ModelConfig,
    dtype: str = "bfloat16",
    group_size: int | None = 128,
    quantize_embeddings: bool = False,
    shapes: ArchShapes | None = None,
) -> WeightBytes:
    """Bytes of all weights stored as `dtype` (see module docstring for what int formats
    include); `shapes`: a non-native model's (arch_shapes), whose other parameters (fused experts
    too) count as `other`."""
    dtype = normalize_dtype(dtype, WEIGHT_BITS, "weight dtype")
    if group_size is not None and group_size < 1:
        raise UsageError(f"--group-size must be a positive integer, got {group_size}")
    bits = WEIGHT_BITS[dtype]
    quantized = dtype.startswith("int")
    float_bytes = 4 if dtype == "float32" else 2  # what unquantized tensors are stored in
    linear = scales = zeros = 0
    layers = 1 if shapes else config.num_layers  # shapes.linears holds every layer's
    for out_f, in_f in shapes.linears if shapes else linear_shapes(config):
        w, s, z = _matrix_bytes(out_f, in_f, bits, group_size, quantized, float_bytes)
        linear, scales, zeros = linear + w, scales + s, zeros + z
    linear, scales, zeros = (layers * x for x in (linear, scales, zeros))
    h, v = config.hidden_size, config.vocab_size
    n_emb = 1 if config.tie_word_embeddings else 2
    w, s, z = _matrix_bytes(v, h, bits, group_size, quantized and quantize_embeddings, float_bytes)
    embeddings, scales, zeros = n_emb * w, scales + n_emb * s, zeros + n_emb * z
    norms_and_biases = config.num_parameters() - _matrix_params(config)
    if shapes:
        matrices = sum(o * i for o, i in shapes.linears) + n_emb * v * h
        norms_and_biases = shapes.num_parameters - matrices
    return WeightBytes(linear, scales, zeros, embeddings, norms_and_biases * float_bytes)


def _matrix_params(config: ModelConfig) -> int:
    """Elements of all 2-D weight matrices (decoder linears + embeddings + untied lm_head)."""
    per_layer = sum(o * i for o, i in linear_shapes(config))
    n_emb = 1 if config.tie_word_embeddings else 2
    return config.num_layers * per_layer + n_emb * config.vocab_size * config.hidden_size


def kv_bytes_per_token(
    config: ModelConfig, kv_dtype: str = "bfloat16", shapes: ArchShapes | None = None
) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element (`shapes`: what the cache
    of a non-native model holds, MLA's per-head width)."""
    kv_dtype = normalize_dtype(kv_dtype, KV_BYTES, "KV dtype")
    if shapes:
        return 2 * shapes.kv_layers * shapes.kv_heads * shapes.kv_width * KV_BYTES[kv_dtype]
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * KV_BYTES[kv_dtype]


def kv_bytes_per_sequence(
    config: ModelConfig,
    seq_len: int,
    kv_dtype: str = "bfloat16",
    block_size: int = 1,
    shapes: ArchShapes | None = None,
) -> int:
    """KV bytes of one sequence of `seq_len` tokens, rounded up to whole cache blocks."""
    tokens = math.ceil(seq_len / block_size) * block_size
    return tokens * kv_bytes_per_token(config, kv_dtype, shapes)


def flops_per_token(config: ModelConfig, context: int, shapes: ArchShapes | None = None) -> int:
    """Forward FLOPs for one token attending to `context` tokens: 2 x matmul weights (the embedding
    lookup is not a matmul; lm_head is) + 4 x layers x context x q_size (Q.K^T and P.V). An MoE
    model's experts count only as far as a token runs through them."""
    per_layer = sum(o * i for o, i in linear_shapes(config))
    matmul_params = config.num_layers * per_layer + config.vocab_size * config.hidden_size
    if shapes:
        experts = shapes.dense_experts
        if shapes.active_parameters is not None:
            experts -= shapes.num_parameters - shapes.active_parameters  # routed, not run
        linears = sum(o * i for o, i in shapes.linears)
        matmul_params = linears + experts + config.vocab_size * config.hidden_size
    return 2 * matmul_params + 4 * config.num_layers * context * config.q_size


@dataclass(frozen=True)
class Estimate:
    """One `profile --estimate` result; sizes in bytes, speeds per second."""

    model: str
    dtype: str
    group_size: int | None
    kv_dtype: str
    seq_len: int
    batch: int
    block_size: int
    num_parameters: int
    weights: WeightBytes
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    kv_bytes_batch: int
    memory_budget: int | None
    max_sequences: int | None  # sequences of seq_len that fit in the budget next to the weights
    bandwidth: float | None  # bytes/s
    decode_bytes_per_step: int  # weights + batch x seq_len x KV per token
    decode_tokens_per_s_per_sequence: float | None
    decode_tokens_per_s_aggregate: float | None
    flops_per_token: int  # at context = seq_len
    active_parameters: int | None = None  # MoE: parameters one token runs through
    notes: tuple[str, ...] = ()  # what the numbers leave out (MLA, sliding windows, experts)

    @property
    def total_bytes(self) -> int:
        return self.weights.total + self.kv_bytes_batch

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["weights"]["total"] = self.weights.total
        d["total_bytes"] = self.total_bytes
        return d


def estimate(
    config: ModelConfig,
    *,
    model: str = "",
    dtype: str = "bfloat16",
    group_size: int | None = 128,
    kv_dtype: str | None = None,
    seq_len: int | None = None,
    batch: int = 1,
    block_size: int = 16,
    memory_budget: int | None = None,
    bandwidth: float | None = None,
    quantize_embeddings: bool = False,
) -> Estimate:
    """Everything `profile --estimate` prints. kv_dtype None: the weights' float dtype (bfloat16
    for int weights);
    seq_len None: the model's max_position_embeddings."""
    dtype = normalize_dtype(dtype, WEIGHT_BITS, "weight dtype")
    if kv_dtype is None:
        kv_dtype = dtype if dtype in ("float32", "float16") else "bfloat16"
    kv_dtype = normalize_dtype(kv_dtype, KV_BYTES, "KV dtype")
    seq_len = config.max_position_embeddings if seq_len is None else seq_len
    for name, value in (("--seq-len", seq_len), ("--batch", batch), ("--block-size", block_size)):
        if value < 1:
            raise UsageError(f"{name} must be >= 1, got {value}")
    if bandwidth is not None and bandwidth <= 0:
        raise UsageError("--bandwidth must be positive")
    shapes = None if config.native else arch_shapes(config)
    weights = weight_bytes(config, dtype, group_size, quantize_embeddings, shapes)
    per_token = kv_bytes_per_token(config, kv_dtype, shapes)
    per_seq = kv_bytes_per_sequence(config, seq_len, kv_dtype, block_size, shapes)
    max_seqs = None if memory_budget is None else max(0, (memory_budget - weights.total) // per_seq)
    step_bytes = weights.total + batch * seq_len * per_token
    steps_per_s = None if bandwidth is None else bandwidth / step_bytes
    return Estimate(
        model=model,
        dtype=dtype,
        group_size=group_size if dtype.startswith("int") else None,
        kv_dtype=kv_dtype,
        seq_len=seq_len,
        batch=batch,
        block_size=block_size,
        num_parameters=shapes.num_parameters if shapes else config.num_parameters(),
        weights=weights,
        kv_bytes_per_token=per_token,
        kv_bytes_per_sequence=per_seq,
        kv_bytes_batch=batch * per_seq,
        memory_budget=memory_budget,
        max_sequences=max_seqs,
        bandwidth=bandwidth,
        decode_bytes_per_step=step_bytes,
        decode_tokens_per_s_per_sequence=steps_per_s,
        decode_tokens_per_s_aggregate=None if steps_per_s is None else batch * steps_per_s,
        flops_per_token=flops_per_token(config, seq_len, shapes),
        active_parameters=shapes.active_parameters if shapes else None,
        notes=shapes.notes if shapes else (),
    )


ESTIMATE_FORMULAS = {
    "weights": "decoder linears at the weight dtype; int formats add one 16-bit scale and one "
    "zero point (packed at the weight bit width) per group of group_size inputs per output row; "
    "embeddings, lm_head, norms and biases 16-bit (float32 for float32)",
    "kv_bytes_per_token": "2 x num_layers x num_kv_heads x head_dim x bytes(kv_dtype)",
    "kv_bytes_per_sequence": "ceil(seq_len / block_size) x block_size x kv_bytes_per_token",
    "kv_bytes_batch": "batch x kv_bytes_per_sequence",
    "max_sequences": "floor((memory_budget - weights.total) / kv_bytes_per_sequence); no "
    "allowance for activations",
    "decode_bytes_per_step": "weights.total + batch x seq_len x kv_bytes_per_token",
    "decode_tokens_per_s_per_sequence": "bandwidth / decode_bytes_per_step (an upper bound)",
    "decode_tokens_per_s_aggregate": "batch x decode_tokens_per_s_per_sequence",
    "flops_per_token": "2 x (decoder linear + lm_head weights) + 4 x num_layers x seq_len x "
    "num_heads x head_dim",
}


_RATE_UNITS = {
    "": 1e9,
    "b/s": 1,
    "kb/s": 1e3,
    "mb/s": 1e6,
    "gb/s": 1e9,
    "tb/s": 1e12,
    "kib/s": 1024,
    "mib/s": 1024**2,
    "gib/s": 1024**3,
    "tib/s": 1024**4,
}


def parse_bandwidth(text: str) -> float:
    """'900GB/s' or '900' (GB/s) or '3.35TB/s' -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z/]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m and unit and not unit.endswith("/s"):
        unit += "/s"
    if not m or unit not in _RATE_UNITS:
        raise UsageError(
            f"cannot read bandwidth {text!r}; use GB/s, e.g. 900 or 900GB/s or 3.35TB/s"
        )
    return float(m.group(1)) * _RATE_UNITS[unit]


def parse_group_size(text: str | int | None) -> int | str | None:
    """--group-size by quantize's rule (llmctl.runtime.formats.spec.parse_group_size): '128' -> 128,
    'channel' -> None (one group per output row), 'auto' -> 'auto' (see `group_size_for`)."""
    from llmctl.runtime.formats.spec import parse_group_size as parse

    value = parse("channel" if text is None else text)
    return None if value == "channel" else value


def group_size_for(
    config: ModelConfig, text: str | int, quantize_embeddings: bool = False
) -> tuple[int | None, str | None]:
    """(group size or None for per channel, note) for this config's quantized matrices, by the
    rule `llmctl quantize` applies: a size it refuses is refused here too, and auto resolves the
    same way."""
    from llmctl.models.linears import config_linears
    from llmctl.runtime.formats.spec import resolve_group_size

    widths = [(name, k) for name, _, k in config_linears(config)]
    if quantize_embeddings:
        widths += [("model.embed_tokens", config.hidden_size), ("lm_head", config.hidden_size)]
    return resolve_group_size(text, widths)


def find_config(target: str) -> tuple[ModelConfig, str]:
    """Read a config from a folder (its config.json), a .json file, or a hub id (downloads only
    config.json).

    Returns (config, where it came from). Offline hub ids fail with one line.
    """
    path = Path(target).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json")
        return ModelConfig.from_file(path / "config.json"), str(path / "config.json")
    if path.is_file():
        return ModelConfig.from_file(path), str(path)
    if target.endswith(".json") or target.count("/") != 1 or target.startswith((".", "/", "~")):
        raise ModelLoadError(f"{target}: no such file or folder")
    local = _hub_config(target)
    return ModelConfig.from_dict(json.loads(Path(local).read_text())), f"hf://{target}"


def _hub_config(repo_id: str) -> str:
    """Path of the hub repo's config.json: from the local hub cache, else downloaded when the hub
    answers."""
    import logging
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo_id=repo_id, filename="config.json", local_files_only=True)
    except Exception:  # not cached: try the network below
        pass
    host = (
        urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
        or "huggingface.co"
    )
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if not offline:
        try:  # fail in seconds, not after the hub client's retries
            socket.create_connection((host, 443), timeout=3).close()
        except OSError:
            offline = True
    if offline:
        raise ModelLoadError(
            f"hub id {repo_id!r} is not in the local cache and {host} is unreachable (offline); "
            "pass a local folder or config.json instead"
        )
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)
    try:
        return hf_hub_download(repo_id=repo_id, filename="config.json")
    except Exception as e:  # unknown or gated repo: one line
        raise ModelLoadError(
            f"cannot fetch config.json of hub id {repo_id!r} ({type(e).__name__}); "
            "pass a local folder or config.json instead"
        ) from None
    finally:
        hub_logger.setLevel(level)
