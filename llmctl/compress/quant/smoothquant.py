"""SmoothQuant (Xiao et al., 2023): migrate activation outliers into the weights before W8A8.

Owns: `smoothing_scales` (per input channel j, s_j = max|X_j|^a / max|W_j|^(1 - a), a the
migration strength, max|W_j| over every linear reading that input), `apply_smoothing` (1/s folded
into the operation before the linears, s into their input columns: an exact rewrite of the
model, up to float rounding) and `SmoothQuantMethod`, the calibration driver's LayerMethod that
observes each linear group's input range over the calibration data and smooths the layer, as
llm-compressor's SmoothQuantModifier does. It quantizes nothing: `llmctl quantize --scheme w8a8
--smoothquant` runs it as a pass of its own before the RTN or GPTQ pass.

Mappings (llmctl.models.layout.SUBLAYER_GROUPS): q/k/v from input_layernorm and gate/up from
post_attention_layernorm (llm-compressor's default Llama mappings), o_proj from v_proj where
that is legal (v's outputs are o's inputs one to one: no grouped-query sharing), and, beyond
llm-compressor's defaults, down_proj from up_proj (its input act(gate) * up is up's output
channel by channel): on SmolLM2-135M-Instruct down_proj's input carried most of W8A8's loss, and
smoothing it took held-out perplexity from +3.2% to +1.75% of bf16 (BENCHMARKS.md, run W8A).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmctl.compress.quant.awq import fold_into_linear_output, fold_into_norm, scale_linear_input
from llmctl.models.layout import SubLayerGroup

DEFAULT_STRENGTH = 0.8  # SmoothQuantModifier's smoothing_strength default in llm-compressor
SMOOTHED_GROUPS = ("attn_in", "attn_out", "mlp_in", "mlp_out")
MIN_SCALE = 1e-5  # s is clamped here (llm-compressor's floor), so no channel divides by zero


def smoothing_scales(
    act_max: torch.Tensor, weights: list[torch.Tensor], strength: float
) -> torch.Tensor:
    """s [in] for inputs whose per-channel max|x| is act_max [in], read by `weights` [out_i, in]:
    s = act_max^a / max|W_col|^(1 - a), float32."""
    w_max = torch.cat([w.detach().float().abs() for w in weights]).amax(dim=0)  # [in]
    a = float(strength)
    s = act_max.float().clamp(min=MIN_SCALE).pow(a) / w_max.clamp(min=MIN_SCALE).pow(1 - a)
    return s.clamp(min=MIN_SCALE)


def apply_smoothing(prev: nn.Module, linears: list[nn.Module], s: torch.Tensor) -> None:
    """Divide prev's output (an RMSNorm's weight, or a linear's rows and bias) by s and multiply
    the linears' input columns by s, in place."""
    if isinstance(prev, nn.Linear):
        fold_into_linear_output(prev.weight, prev.bias, s)
    else:
        fold_into_norm(prev.weight, s)
    for lin in linears:
        scale_linear_input(lin.weight, s)


def can_smooth(group: SubLayerGroup, prev: nn.Module, linears: list[nn.Module]) -> bool:
    """The group is one SmoothQuant smooths, and a linear prev maps one to one onto the inputs."""
    if group.name not in SMOOTHED_GROUPS:
        return False
    if isinstance(prev, nn.Linear):
        return all(prev.out_features == lin.in_features for lin in linears)
    return hasattr(prev, "weight") and prev.weight.dim() == 1


class SmoothQuantMethod:
    """LayerMethod: per group, max|x| per input channel over every calibration token, then the
    smoothing folded into the layer. whole_layer: all groups are observed on the unchanged layer
    (each smoothing is exact, so none changes what another group's statistics should be)."""

    whole_layer = True

    def __init__(self, strength: float = DEFAULT_STRENGTH):
        self.strength = strength
        self.act_max: dict[str, torch.Tensor] = {}  # full linear name -> [in]
        self.scales: dict[str, torch.Tensor] = {}  # "layer.group" -> s applied (for tests)

    def observe(self, name: str, x: torch.Tensor) -> None:
        m = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float().cpu()
        old = self.act_max.get(name)
        self.act_max[name] = m if old is None else torch.maximum(old, m)

    def process_group(
        self, layer_index: int, layer: nn.Module, group: SubLayerGroup, names: list[str]
    ) -> dict[str, Any]:
        maxes = [self.act_max.pop(n) for n in names if n in self.act_max]
        linears = [layer.get_submodule(rel) for rel in group.linears]  # ignored ones too
        prev = layer.get_submodule(group.prev)
        if not maxes or not can_smooth(group, prev, linears):
            return {}
        act_max = torch.stack(maxes).amax(dim=0)
        s = smoothing_scales(act_max, [lin.weight for lin in linears], self.strength)
        apply_smoothing(prev, linears, s.to(linears[0].weight.device))
        self.scales[f"{layer_index}.{group.name}"] = s
        return {}

    def finish_layer(self, layer_index: int, layer: nn.Module) -> dict[str, Any]:
        self.act_max.clear()
        return {}
