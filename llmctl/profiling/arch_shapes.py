"""The shapes `profile estimate` needs of a model our own model code does not run (the
transformers path), from its config alone: the transformers model built on the meta device (no
weights), counted.

Owns: `ArchShapes` and `arch_shapes(config)`: every parameter; the decoder linears `llmctl
quantize` would quantize (llmctl.models.linears: never routers or gates); fused 3-D expert
parameters (which quantize keeps dense); the parameters one token runs through in an MoE model
(top-k of the routed experts); and what the engine's paged cache stores per token: K and V of
(KV heads x width) per layer, where MLA caches each head's decompressed keys and values (width:
the larger of the key and value sizes), as models/transformers_backend.py's probe finds. Notes
say what a cache aware of MLA's compression or of sliding windows would hold instead.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchShapes:
    num_parameters: int  # every parameter (tied embeddings once)
    linears: tuple[tuple[int, int], ...]  # (out, in) of every decoder linear quantize changes
    dense_experts: int  # fused 3-D expert parameters: stay dense under quantize
    active_parameters: int | None  # MoE: parameters one token runs through; None when dense
    kv_layers: int
    kv_heads: int
    kv_width: int  # elements per head of K (and of V) in the cache
    notes: tuple[str, ...] = ()


def _experts_per_token(t) -> int:
    return int(getattr(t, "num_experts_per_tok", None) or getattr(t, "top_k", None) or 0)


def _kv(t, config) -> tuple[int, int, list[str]]:
    """(KV heads, width per head, notes) of the engine's cache."""
    notes = []
    if getattr(t, "kv_lora_rank", None):
        qk = int(t.qk_nope_head_dim) + int(t.qk_rope_head_dim)
        compressed = int(t.kv_lora_rank) + int(t.qk_rope_head_dim)
        heads, width = int(t.num_attention_heads), max(qk, int(t.v_head_dim))
        notes.append(
            f"MLA: the cache holds each head's decompressed K and V ({2 * heads * width} elements "
            f"per layer per token); an MLA-aware cache holds the compressed {compressed}"
        )
        return heads, width, notes
    kinds = list(getattr(t, "layer_types", None) or [])
    window = getattr(t, "sliding_window", None)
    sliding = sum(1 for k in kinds if "sliding" in str(k))
    if window and sliding:
        notes.append(
            f"{sliding} of {len(kinds)} layers attend within {window} tokens; the paged cache "
            "keeps every token's K and V for them too"
        )
    return config.num_kv_heads, config.head_dim, notes


def arch_shapes(config) -> ArchShapes:
    """See the module docstring; `config` is a ModelConfig that is not native."""
    from llmctl.models.linears import compressible_linears, fused_experts, meta_model

    model = meta_model(config.raw)
    t = model.config.get_text_config()
    total = sum(p.numel() for p in model.parameters())  # shared (tied) parameters once
    _, experts = fused_experts(model)
    n_experts = next(
        (
            int(v)
            for k in ("num_experts", "num_local_experts", "n_routed_experts")
            if (v := getattr(t, k, None))
        ),
        0,
    )
    active = None
    if experts and n_experts:
        active = total - experts + experts * _experts_per_token(t) // n_experts
    heads, width, notes = _kv(t, config)
    if experts:
        notes.append(f"{experts:,} fused expert parameters stay 16-bit (quantize keeps them dense)")
    linears = tuple((o, i) for _, o, i in compressible_linears(model))
    return ArchShapes(
        total, linears, experts, active, config.num_layers, heads, width, tuple(notes)
    )
