"""transformers 5's fused MoE experts as one nn.Linear per expert projection, for compression and
for loading a checkpoint whose experts are quantized one by one.

transformers 5 stores the routed experts of most MoE families as two 3-D parameters of one
module (`gate_up_proj` [E, 2I, H], gate rows before up rows; `down_proj` [E, H, I]) called as
`experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`. Calibration hooks see
nn.Linear inputs only, and checkpoints (vLLM's, llm-compressor's) hold each expert's
projections as tensors of their own, so:

Owns: `UnfusedExperts` (an nn.ModuleList of `ExpertLinears`: expert e's projections are
`experts.e.gate_proj` / `up_proj` / `down_proj`, mixtral's `w1` / `w3` / `w2`, the checkpoint's
names; its forward is the fused module's eager loop, expert by expert in index order, the same
products in the same order), `unfuse_experts` (swap them in, weights copied, on any device
including meta) and `UNFUSABLE`, the fused classes whose forward this reproduces (checked
against transformers 5.25: act(gate) * up, no biases, routing weights applied to each expert's
output before adding it into place). Other layouts (gpt_oss's interleaved gate/up with biases,
deepseek_v3's) stay fused and dense (models/linears.py `fused_experts`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
# fused class name -> the checkpoint's names of each expert's gate, up and down projections
UNFUSABLE = {
    "Qwen2MoeExperts": GATE_UP_DOWN,
    "Qwen3MoeExperts": GATE_UP_DOWN,
    "OlmoeExperts": GATE_UP_DOWN,
    "MixtralExperts": ("w1", "w3", "w2"),
}


class ExpertLinears(nn.Module):
    """One expert: gate, up [I, H] and down [H, I] linears under the checkpoint's names."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str], act, device=None):
        super().__init__()
        self.names, self.act_fn = names, act
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, inter, bias=False, device=device))
        setattr(self, up, nn.Linear(hidden, inter, bias=False, device=device))
        setattr(self, down, nn.Linear(inter, hidden, bias=False, device=device))

    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        return tuple(self._modules[n] for n in self.names)  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] (one tensor read by gate and up: the driver groups them) -> [n, H]."""
        gate, up, down = self.projections()
        return down(self.act_fn(gate(x)) * up(x))


class UnfusedExperts(nn.ModuleList):
    """A fused experts module's forward over per-expert `ExpertLinears` (module docstring)."""

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden_states [T, H], top_k_index / top_k_weights [T, k] -> [T, H]."""
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # [E + 1, k, T]: mask[e, j, t] = token t's j-th choice is expert e (index E: none,
            # as transformers' expert-parallel masking writes it)
            mask = F.one_hot(top_k_index, num_classes=len(self) + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in (e for e in hit[:, 0].tolist() if e < len(self)):
            top_k_pos, token_idx = torch.where(mask[e])
            y = self[e](hidden_states[token_idx])
            y = y * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def _unfused(fused: nn.Module, names: tuple[str, str, str]) -> UnfusedExperts:
    """The per-expert twin of `fused`, holding copies of its weights."""
    gate_up, down = fused.gate_up_proj, fused.down_proj  # [E, 2I, H], [E, H, I]
    n, inter, hidden = gate_up.shape[0], gate_up.shape[1] // 2, gate_up.shape[2]
    experts = UnfusedExperts(
        ExpertLinears(hidden, inter, names, fused.act_fn, device=gate_up.device) for _ in range(n)
    )
    with torch.no_grad():
        for e, expert in enumerate(experts):
            g, u, d = expert.projections()
            g.weight.copy_(gate_up[e, :inter])
            u.weight.copy_(gate_up[e, inter:])
            d.weight.copy_(down[e])
    return experts.to(gate_up.dtype).requires_grad_(False)


def unfuse_experts(root: nn.Module) -> list[str]:
    """Replace every fused experts module of an `UNFUSABLE` class in `root` by its
    `UnfusedExperts` (same forward, same weights); returns their names."""
    done = []
    for name, module in list(root.named_modules()):
        names = UNFUSABLE.get(type(module).__name__)
        if names is None or "." not in name:
            continue
        parent, child = name.rsplit(".", 1)
        setattr(root.get_submodule(parent), child, _unfused(module, names))
        done.append(name)
    return done
