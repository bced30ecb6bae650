"""The quantization methods wired to the calibration driver (llmctl/compress/driver.py).

Owns: `LinearRecord` (what each quantized linear reports), `relative_output_error`, the per-linear
GPTQ and RTN functions for `HessianMethod`, and `AwqMethod`, which searches and folds scales
group by group on the full-precision layer and clips and quantizes all its linears at the end of
the layer (as AutoAWQ does), so folding 1/s into v_proj or up_proj happens before they are
quantized.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmctl.compress.driver import HessianMethod, SubLayerGroup, relative_name
from llmctl.compress.hessian import HessianAccumulator
from llmctl.compress.quant.awq import (
    quantize_awq,
    search_scales,
)
from llmctl.compress.quant.gptq import quantize_gptq
from llmctl.compress.quant.rtn import quantize_rtn
from llmctl.compress.quant.smoothquant import apply_smoothing
from llmctl.compress.records import LinearRecord, relative_output_error
from llmctl.runtime.formats.spec import QuantResult, QuantSpec


def _set_weight(linear: nn.Linear, w: torch.Tensor) -> None:
    linear.weight.data.copy_(w.to(linear.weight.dtype))


def gptq_method(
    spec: QuantSpec,
    *,
    act_order: bool = False,
    dampening: float = 0.01,
    column_block: int = 32,
    preserve_zeros: bool = True,
    mse: bool = True,
    refit_groups: bool = True,
    static_groups: bool = True,
    whole_layer: bool = True,
) -> HessianMethod:
    """GPTQ per linear. RTN and AWQ map an exact zero to its zero point, so they keep zeros by
    construction; GPTQ's error feedback would refill them, hence the mask of exact zeros.

    Defaults measured (BENCHMARKS.md Q17g): no act-order, MSE ranges, the layer observed whole,
    groups fitted on the original weights (llm-compressor's rules); act-order refits instead."""

    def quantize(name: str, w: torch.Tensor, H: torch.Tensor):
        # exact zeros stay exactly zero (sparse-then-quantize); a dense weight has next to none
        mask = (w == 0) if preserve_zeros and bool((w == 0).any()) else None
        return quantize_gptq(
            w,
            H,
            spec.for_width(name, w.shape[1]),
            dampening=dampening,
            column_block=column_block,
            act_order=act_order,
            mask=mask,
            mse=mse,
            refit_groups=refit_groups,
            static_groups=static_groups and not act_order,
        )

    def fn(name: str, linear: nn.Linear, H: torch.Tensor) -> LinearRecord:
        w = linear.weight.detach().float().cpu().clone()
        H = H.cpu()
        r = quantize(name, w, H)
        _set_weight(linear, r.weight)
        return LinearRecord(name, tuple(w.shape), r, relative_output_error(w, r.weight, H))

    def group_fn(names: list[str], linears: list[nn.Linear], H: torch.Tensor) -> dict:
        # rows are independent given H (one inverse Hessian, one column order, per-row groups),
        # so linears that share their input are quantized as one stacked weight [sum out, in]
        ws = [lin.weight.detach().float().cpu().clone() for lin in linears]
        H = H.cpu()
        stacked = quantize(names[0], torch.cat(ws), H)
        records, row = {}, 0
        for name, linear, w in zip(names, linears, ws):
            r = _rows(stacked, row, row + w.shape[0])
            row += w.shape[0]
            _set_weight(linear, r.weight)
            records[name] = LinearRecord(
                name, tuple(w.shape), r, relative_output_error(w, r.weight, H)
            )
        return records

    return HessianMethod(fn, group_fn, whole_layer=whole_layer)


def _rows(r: QuantResult, a: int, b: int) -> QuantResult:
    """Rows [a, b) of a quantized weight, as their own result (contiguous copies)."""
    return QuantResult(
        r.codes[a:b].clone(),
        r.scales[a:b].clone(),
        r.zeros[a:b].clone(),
        r.weight[a:b].clone(),
        r.spec,
        r.g_idx,
    )


def rtn_method(spec: QuantSpec, *, mse: bool = True) -> HessianMethod:
    """RTN needs no data; run through the driver only to report the same output error as the
    others. mse (default): each group's range from the MSE shrink search, not its min/max."""

    def fn(name: str, linear: nn.Linear, H: torch.Tensor) -> LinearRecord:
        w = linear.weight.detach().float().cpu().clone()
        r = quantize_rtn(w, spec.for_width(name, w.shape[1]), mse=mse)
        _set_weight(linear, r.weight)
        return LinearRecord(name, tuple(w.shape), r, relative_output_error(w, r.weight, H.cpu()))

    return HessianMethod(fn)


class AwqMethod:
    """LayerMethod for AWQ: per group, scale search and folding; at the layer's end, clip and
    quantize. Defaults (measured, benchmarks/bench_quant_quality.py): the paper's scales
    s = mean|x|^alpha (duo False), the clip search, min/max ranges after clipping (mse False:
    a second shrink on top of the clip search lost) and the MSE range search for q/k_proj, which
    the clip search skips (unclipped_mse True); clip_hessian and search_mse measured worse."""

    def __init__(
        self,
        spec: QuantSpec,
        *,
        n_grid: int = 20,
        max_tokens: int = 4096,
        clip: bool = True,
        duo: bool = False,
        mse: bool = False,
        clip_tokens: int = 512,
        clip_hessian: bool = False,
        search_mse: bool = False,
        unclipped_mse: bool = True,
    ):
        self.spec, self.n_grid, self.max_tokens, self.clip = spec, n_grid, max_tokens, clip
        self.duo, self.mse, self.clip_tokens = duo, mse, clip_tokens
        self.clip_hessian, self.search_mse = clip_hessian, search_mse
        self.unclipped_mse = unclipped_mse  # MSE ranges for the linears the clip search skips
        self.xs: dict[str, list[torch.Tensor]] = {}
        self.seqs: dict[str, list[torch.Tensor]] = {}
        self.acc: dict[str, HessianAccumulator] = {}
        self.pending: dict[
            str, tuple[torch.Tensor, torch.Tensor, float | None]
        ] = {}  # name -> (x sample, H, alpha)

    def observe(self, name: str, x: torch.Tensor) -> None:
        x2 = x.reshape(-1, x.shape[-1]).float().cpu()
        self.xs.setdefault(name, []).append(x2)
        seqs = self.seqs.setdefault(name, [])
        if sum(t.shape[0] * t.shape[1] for t in seqs) < self.max_tokens and x.dim() == 3:
            seqs.append(x.detach())  # whole sequences, for the attention block's objective
        if name not in self.acc:
            self.acc[name] = HessianAccumulator(x2.shape[-1])
        self.acc[name].add(x2)

    def _sample(self, name: str) -> torch.Tensor:
        x = torch.cat(self.xs.pop(name))
        if x.shape[0] > self.max_tokens:
            x = x[torch.linspace(0, x.shape[0] - 1, self.max_tokens).long()]
        return x

    def process_group(
        self, layer_index: int, layer: nn.Module, group: SubLayerGroup, names: list[str]
    ) -> dict[str, Any]:
        # the group's linears share their inputs, hence one width
        spec = self.spec.for_width(names[0], self.acc[names[0]].H.shape[0])
        x = self._sample(names[0])
        H = self.acc[names[0]].H
        for n in names[1:]:
            self.xs.pop(n, None)
        linears = [layer.get_submodule(rel) for rel in group.linears]  # all, ignored ones too
        prev = layer.get_submodule(group.prev)
        alpha = None
        if self._can_fold(prev, linears):
            quantized = [
                layer.get_submodule(relative_name(n)).weight.detach().float() for n in names
            ]
            block = self._block(layer, group, names)
            found = search_scales(
                x,
                quantized,
                spec,
                n_grid=self.n_grid,
                block=block,
                duo=self.duo,
                mse=self.search_mse,
            )
            s = found.scales
            if found.alpha > 0:
                apply_smoothing(prev, linears, s)  # the same fold as SmoothQuant's
                x = x / s[None, :]
                H = H / (s[:, None] * s[None, :])
            alpha = found.alpha
        for n in names:
            self.seqs.pop(n, None)
            self.pending[n] = (x, H, alpha)
            self.acc.pop(n)
        return {}

    def _block(self, layer: nn.Module, group: SubLayerGroup, names: list[str]):
        """The objective of the scale search: the whole attention (q/k/v) or MLP (gate/up) output,
        as AutoAWQ measures it; None (the linears' own outputs) for o_proj and down_proj."""
        if group.name not in ("attn_in", "mlp_in"):
            return None
        modules = [layer.get_submodule(relative_name(n)) for n in names]
        xs = torch.cat(self.seqs[names[0]])  # [B, S, in]
        positions = torch.arange(xs.shape[1], device=xs.device)

        def run(ws: list[torch.Tensor]) -> torch.Tensor:
            saved = [m.weight.data for m in modules]
            try:
                for m, w in zip(modules, ws):
                    m.weight.data = w.to(m.weight.device, m.weight.dtype)
                if group.name == "attn_in":
                    return layer.self_attn.forward_dense(xs, positions)[0].float()
                return layer.mlp(xs).float()
            finally:
                for m, w in zip(modules, saved):
                    m.weight.data = w

        return run

    @staticmethod
    def _can_fold(prev: nn.Module, linears: list[nn.Module]) -> bool:
        """v_proj -> o_proj only when v's outputs map one to one onto o's inputs (no GQA
        sharing)."""
        if isinstance(prev, nn.Linear):
            return all(prev.out_features == lin.in_features for lin in linears)
        return True

    def finish_layer(self, layer_index: int, layer: nn.Module) -> dict[str, Any]:
        records = {}
        for name, (x, H, alpha) in self.pending.items():
            linear = layer.get_submodule(relative_name(name))
            w = linear.weight.detach().float().cpu().clone()
            # AutoAWQ leaves q/k unclipped: attention scores are too sensitive to their range
            clip = self.clip and not name.endswith(("q_proj", "k_proj"))
            lspec = self.spec.for_width(name, w.shape[1])
            r = quantize_awq(
                w,
                x,
                lspec,
                clip=clip,
                mse=self.mse or (self.unclipped_mse and not clip),
                clip_tokens=self.clip_tokens,
                H=H if self.clip_hessian else None,
            )
            _set_weight(linear, r.weight)
            records[name] = LinearRecord(
                name, tuple(w.shape), r, relative_output_error(w, r.weight, H), alpha
            )
        self.pending.clear()
        return records
