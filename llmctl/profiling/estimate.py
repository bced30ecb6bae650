"""Memory and speed estimates from a model's config.json alone (no weights): arithmetic on the
config (the Llama layout) or on counts of transformers' meta-device model (other families).

Owns: parameter and weight-byte counts per storage format (int4/int8 with their per-group scales and
zero points), KV-cache bytes per token / sequence / batch, how many sequences fit in a memory
budget, the bandwidth-bound decode ceiling and FLOPs per token (used for MFU). `find_config`
(profiling/config_source.py) is re-exported here.

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
- Families other than llama/mistral/qwen2/qwen3 are counted on transformers' model of the config
  built on the meta device (profiling/arch_counts.py): "decoder linears" are its nn.Linear/Conv1D
  modules and 3-D expert weights, packed as quantize packs them (routers, norms, biases: 16-bit).
- MoE: `active_parameters` = all but the routed experts + k/E of them (k experts per token of E).
  A decode step of batch b reads, per MoE layer, the expected distinct experts its b tokens were
  routed to, E x (1 - (1 - k/E)^b) (uniform, independent routing), so the step's weight bytes are
  weights.total - experts + experts x (1 - (1 - k/E)^b); FLOPs per token use the active ones.
- KV bytes per token are what llmctl's engine allocates: every attention layer keeps K and V of
  all its KV heads at the cache head size (the wider of key and value). MLA models (deepseek)
  therefore cache decompressed K/V; `kv_bytes_per_token_mla_latent` is what a latent cache
  (kv_lora_rank + qk_rope_head_dim per layer) would need. Sliding-window layers keep every token
  today; `kv_bytes_per_sequence_windowed` is what a cache capped at the window would hold.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from llmctl.errors import UsageError
from llmctl.models.config import ModelConfig
from llmctl.profiling.arch_counts import arch_counts, llama_layout
from llmctl.profiling.config_source import find_config  # noqa: F401 (re-exported)
from llmctl.profiling.dtypes import canonical_dtype

# Weight storage formats and their bits per element.
WEIGHT_BITS = {"float32": 32, "bfloat16": 16, "float16": 16, "int8": 8, "int4": 4}
# KV-cache element formats and their bytes per element.
# run-batch's --kv-cache-dtype values (fp8 = fp8_e4m3) and int8 (an estimate only)
KV_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1} | dict.fromkeys(
    ("fp8", "fp8_e4m3", "fp8_e5m2"), 1
)
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
) -> WeightBytes:
    """Bytes of all weights stored as `dtype` (see module docstring for what int formats
    include)."""
    return _weight_parts(config, dtype, group_size, quantize_embeddings)[0]


def _weight_parts(
    config: ModelConfig, dtype: str, group_size: int | None, quantize_embeddings: bool
) -> tuple[WeightBytes, int]:
    """(weight bytes, the routed experts' share of their total: 0 for a dense model)."""
    dtype = normalize_dtype(dtype, WEIGHT_BITS, "weight dtype")
    if group_size is not None and group_size < 1:
        raise UsageError(f"--group-size must be a positive integer, got {group_size}")
    bits = WEIGHT_BITS[dtype]
    quantized = dtype.startswith("int")
    float_bytes = 4 if dtype == "float32" else 2  # what unquantized tensors are stored in
    linear = scales = zeros = experts = 0
    packable = llama_layout(config) or arch_counts(config).experts_packed  # as quantize does
    for out_f, in_f, count, expert in decoder_matrices(config):
        packed = quantized and (packable or not expert)
        w, s, z = _matrix_bytes(out_f, in_f, bits, group_size, packed, float_bytes)
        linear, scales, zeros = linear + count * w, scales + count * s, zeros + count * z
        experts += count * (w + s + z) if expert else 0
    v, h, n_emb = _embedding(config)
    w, s, z = _matrix_bytes(v, h, bits, group_size, quantized and quantize_embeddings, float_bytes)
    embeddings, scales, zeros = n_emb * w, scales + n_emb * s, zeros + n_emb * z
    others = num_parameters(config) - _matrix_params(config)
    if not llama_layout(config):  # routed experts' biases stay float
        c = arch_counts(config)
        experts += (c.expert_parameters - _expert_matrix_params(c)) * float_bytes
    return WeightBytes(linear, scales, zeros, embeddings, others * float_bytes), experts


def decoder_matrices(config: ModelConfig) -> list[tuple[int, int, int, bool]]:
    """(out_features, in_features, how many, routed expert) of the decoder's matrices: the Llama
    layout's 7 per layer for native configs, the meta model's (profiling/arch_counts.py) else."""
    if llama_layout(config):
        return [(o, i, config.num_layers, False) for o, i in linear_shapes(config)]
    return list(arch_counts(config).matrices)


def _embedding(config: ModelConfig) -> tuple[int, int, int]:
    """(vocab, hidden, 1 when the lm_head is tied to the input embedding else 2)."""
    if llama_layout(config):
        return config.vocab_size, config.hidden_size, 1 if config.tie_word_embeddings else 2
    c = arch_counts(config)
    return c.vocab_size, c.hidden_size, c.embeddings


def _matrix_params(config: ModelConfig) -> int:
    """Elements of all 2-D weight matrices (decoder linears + embeddings + untied lm_head)."""
    v, h, n_emb = _embedding(config)
    return sum(o * i * n for o, i, n, _ in decoder_matrices(config)) + n_emb * v * h


def _expert_matrix_params(c) -> int:
    return sum(o * i * n for o, i, n, expert in c.matrices if expert)


def num_parameters(config: ModelConfig) -> int:
    """Every parameter of the checkpoint, a tied embedding once."""
    return config.num_parameters() if llama_layout(config) else arch_counts(config).num_parameters


def active_parameters(config: ModelConfig) -> int:
    """Parameters one token runs through: a MoE's routed experts at k / E, all else whole."""
    return (
        config.num_parameters() if llama_layout(config) else arch_counts(config).active_parameters
    )


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str = "bfloat16") -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    kv_dtype = normalize_dtype(kv_dtype, KV_BYTES, "KV dtype")
    if not llama_layout(config):  # the engine's cache shape, by its load-time probe
        c = arch_counts(config)
        return 2 * len(c.attention) * c.cache_kv_heads * c.cache_head_dim * KV_BYTES[kv_dtype]
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * KV_BYTES[kv_dtype]


def kv_bytes_per_sequence(
    config: ModelConfig, seq_len: int, kv_dtype: str = "bfloat16", block_size: int = 1
) -> int:
    """KV bytes of one sequence of `seq_len` tokens, rounded up to whole cache blocks."""
    tokens = math.ceil(seq_len / block_size) * block_size
    return tokens * kv_bytes_per_token(config, kv_dtype)


def flops_per_token(config: ModelConfig, context: int) -> int:
    """Forward FLOPs for one token attending to `context` tokens: 2 x matmul weights (the embedding
    lookup is not a matmul; lm_head is) + 4 x layers x context x q_size (Q.K^T and P.V)."""
    if not llama_layout(config):
        return arch_counts(config).flops_per_token(context)
    per_layer = sum(o * i for o, i in linear_shapes(config))
    matmul_params = config.num_layers * per_layer + config.vocab_size * config.hidden_size
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
    flops_per_token: int  # at context = seq_len (a MoE's active parameters)
    # every family (see the module docstring): equal to num_parameters for a dense model
    active_parameters: int = 0
    num_experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    expert_weight_bytes: int = 0  # the routed experts' share of weights.total
    decode_experts_touched: float | None = None  # expected distinct experts per layer per step
    # what a cache unlike llmctl's would need (None: not that kind of model)
    kv_bytes_per_token_mla_latent: int | None = None  # MLA's compressed latent
    kv_bytes_per_sequence_windowed: int | None = None  # sliding-window layers capped at the window

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
    weights, expert_bytes = _weight_parts(config, dtype, group_size, quantize_embeddings)
    per_token = kv_bytes_per_token(config, kv_dtype)
    per_seq = kv_bytes_per_sequence(config, seq_len, kv_dtype, block_size)
    max_seqs = None if memory_budget is None else max(0, (memory_budget - weights.total) // per_seq)
    family = _family_fields(config, per_token, kv_dtype, seq_len, batch, block_size)
    step_bytes = weights.total + batch * seq_len * per_token
    if expert_bytes:  # a decode step reads only the experts its tokens were routed to
        touched = family["decode_experts_touched"] / family["num_experts"]
        step_bytes -= expert_bytes - math.ceil(expert_bytes * touched)
    steps_per_s = None if bandwidth is None else bandwidth / step_bytes
    return Estimate(
        model=model,
        dtype=dtype,
        group_size=group_size if dtype.startswith("int") else None,
        kv_dtype=kv_dtype,
        seq_len=seq_len,
        batch=batch,
        block_size=block_size,
        num_parameters=num_parameters(config),
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
        flops_per_token=flops_per_token(config, seq_len),
        expert_weight_bytes=expert_bytes,
        **family,
    )


def _family_fields(
    config: ModelConfig, per_token: int, kv_dtype: str, seq_len: int, batch: int, block_size: int
) -> dict[str, Any]:
    """The Estimate fields beyond the Llama layout: MoE's active parameters and experts a step
    touches, MLA's latent and sliding windows' capped KV (see the module docstring)."""
    if llama_layout(config):
        return {"active_parameters": config.num_parameters()}
    return arch_counts(config).estimate_fields(
        per_token, KV_BYTES[kv_dtype], seq_len, batch, block_size
    )


ESTIMATE_FORMULAS = {
    "weights": "decoder linears at the weight dtype; int formats add one 16-bit scale and one "
    "zero point (packed at the weight bit width) per group of group_size inputs per output row; "
    "embeddings, lm_head, norms and biases 16-bit (float32 for float32)",
    "kv_bytes_per_token": "2 x num_layers x num_kv_heads x head_dim x bytes(kv_dtype); other "
    "families: attention layers, KV heads and the wider of key and value sizes, as the engine's "
    "load-time probe finds them",
    "kv_bytes_per_sequence": "ceil(seq_len / block_size) x block_size x kv_bytes_per_token",
    "kv_bytes_batch": "batch x kv_bytes_per_sequence",
    "max_sequences": "floor((memory_budget - weights.total) / kv_bytes_per_sequence); no "
    "allowance for activations",
    "decode_bytes_per_step": "weights.total + batch x seq_len x kv_bytes_per_token",
    "decode_tokens_per_s_per_sequence": "bandwidth / decode_bytes_per_step (an upper bound)",
    "decode_tokens_per_s_aggregate": "batch x decode_tokens_per_s_per_sequence",
    "flops_per_token": "2 x (decoder linear + lm_head weights) + 4 x num_layers x seq_len x "
    "num_heads x head_dim; other families: active decoder matrices, and per attention layer 2 x "
    "min(seq_len, window) x query heads x (key size + value size)",
    "active_parameters": "num_parameters - routed experts' parameters x (1 - k / E)",
    "decode_experts_touched": "E x (1 - (1 - k / E)^batch) distinct experts per MoE layer "
    "(uniform, independent routing); decode_bytes_per_step then counts expert_weight_bytes x "
    "decode_experts_touched / E instead of all of them",
    "kv_bytes_per_token_mla_latent": "attention layers x (kv_lora_rank + qk_rope_head_dim) x "
    "bytes(kv_dtype): a latent cache, not what llmctl allocates (decompressed K/V)",
    "kv_bytes_per_sequence_windowed": "sum over attention layers of ceil(min(seq_len, window) / "
    "block_size) x block_size x the layer's KV bytes per token: a window-capped cache, not what "
    "llmctl allocates (every token)",
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
    from llmctl.models.layout import decoder_linears
    from llmctl.runtime.formats.spec import resolve_group_size

    if llama_layout(config):
        widths = [(name, k) for name, _, k in decoder_linears(config)]
    else:
        widths = [(f"a {o}x{i} decoder matrix", i) for o, i, _, _ in decoder_matrices(config)]
    if quantize_embeddings:
        widths += [("model.embed_tokens", config.hidden_size), ("lm_head", config.hidden_size)]
    return resolve_group_size(text, widths)
