"""Merged projections for inference, as vLLM's QKVParallelLinear and MergedColumnParallelLinear:
the linears of a decoder layer that read one input (q/k/v, gate/up) run as one GEMM over one
weight [sum of N, K] (one larger call instead of two or three: fewer kernel launches, one pass
over the input, larger tiles for oneDNN/AMX).

Owns: building the merged weight (`merge`: the parts' parameters are replaced by views into its
rows, so memory does not double and the Hugging Face names still load and save), and the check
a forward pass makes before using it (`Merged.live`): the parts must still be the same modules
viewing the same memory, so a layer quantized, pruned into a new tensor, cast or moved after the
merge falls back to its separate projections. Parts must all be plain `Linear` modules over
plain CPU/GPU tensors of one dtype and device, with biases on all or none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class Merged:
    """One linear serving `parts` (in order): its output [..., sum(sizes)] splits into theirs."""

    linear: nn.Linear  # not registered in any module: state dicts see only the parts
    parts: tuple[nn.Module, ...]
    sizes: tuple[int, ...]  # out_features of each part
    pointers: tuple[int, ...]  # the data pointer each part's weight must still have

    def live(self, *modules: nn.Module) -> bool:
        """Whether `modules` (the layer's current parts) are still the merged ones, viewing the
        merged weight, with no hooks (calibration's input hooks must see their calls); cheap:
        a few identity and pointer tests a call."""
        for m, part, ptr in zip(modules, self.parts, self.pointers):
            if m is not part or m.weight.data_ptr() != ptr:
                return False
            if m._forward_hooks or m._forward_pre_hooks:
                return False
        return True


def mergeable(parts: Sequence[nn.Module], linear_type: type) -> bool:
    """All parts exactly `linear_type` over plain tensors of one dtype, device and K, biases on
    all or none."""
    if not parts or any(type(p) is not linear_type for p in parts):
        return False
    w0 = parts[0].weight
    for p in parts:
        w = p.weight
        if type(w.data) is not torch.Tensor or w.dim() != 2 or not w.is_contiguous():
            return False
        if w.dtype is not w0.dtype or w.device != w0.device or w.shape[1] != w0.shape[1]:
            return False
        if (p.bias is None) != (parts[0].bias is None):
            return False
    return True


def _view_rows(part: nn.Module, name: str, merged: torch.Tensor, start: int, stop: int) -> None:
    old = getattr(part, name)
    setattr(part, name, nn.Parameter(merged[start:stop], requires_grad=old.requires_grad))


def merge(parts: Sequence[nn.Module], linear_type: type) -> Merged | None:
    """A `linear_type` whose weight (and bias) is the parts' stacked along N; the parts' weight
    and bias become views into it. None where `mergeable` is false."""
    if not mergeable(parts, linear_type):
        return None
    with torch.no_grad():
        weight = torch.cat([p.weight.detach() for p in parts])  # [sum N, K]
        bias = None
        if parts[0].bias is not None:
            bias = torch.cat([p.bias.detach() for p in parts])
    sizes = tuple(p.weight.shape[0] for p in parts)
    linear = linear_type(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    start = 0
    for p, n in zip(parts, sizes):
        _view_rows(p, "weight", weight, start, start + n)
        if bias is not None:
            _view_rows(p, "bias", bias, start, start + n)
        start += n
    pointers = tuple(p.weight.data_ptr() for p in parts)
    return Merged(linear, tuple(parts), sizes, pointers)


def refreshed(current: Merged | None, parts: Sequence[nn.Module], linear_type: type):
    """`current` where it still serves `parts` (Merged.live), else a new `merge` of them; None
    where they cannot merge."""
    if current is not None and current.live(*parts):
        return current
    return merge(parts, linear_type)
