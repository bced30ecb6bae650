"""The linears of a Llama-family decoder layer, from the config alone (no weights).

Owns: `SUBLAYER_GROUPS` (the linears that read the same input, in forward order, and the operation
whose output they read: calibration handles a group at a time and AWQ folds scales into `prev`),
`LINEAR_NAMES` and `decoder_linears` (every decoder linear's name and shape), used by compression
and by the memory estimates.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SubLayerGroup:
    name: str
    linears: tuple[str, ...]  # names relative to the decoder layer
    prev: str  # the operation whose output the linears read (AWQ folds its scales into it)


SUBLAYER_GROUPS = (
    SubLayerGroup(
        "attn_in", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"
    ),
    SubLayerGroup("attn_out", ("self_attn.o_proj",), "self_attn.v_proj"),
    SubLayerGroup("mlp_in", ("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
    SubLayerGroup("mlp_out", ("mlp.down_proj",), "mlp.up_proj"),
)


LINEAR_NAMES = tuple(rel for group in SUBLAYER_GROUPS for rel in group.linears)


def decoder_linears(config) -> list[tuple[str, int, int]]:
    """(full name, out_features, in_features) of every decoder linear, from a ModelConfig alone
    (no weights), in forward order."""
    h, f, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    shapes = dict(zip(LINEAR_NAMES, ((q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f))))
    return [
        (f"model.layers.{i}.{rel}", *shapes[rel])
        for i in range(config.num_layers)
        for rel in LINEAR_NAMES
    ]
