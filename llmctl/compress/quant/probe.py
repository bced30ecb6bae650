"""The round-to-nearest probe of `llmctl quantize --gptq/--awq`: what plain RTN with the same
settings would have scored on the same held-out tokens, so the report can warn when the
calibrated method did worse.

Owns: `rtn_probe` (held-out perplexity of the model with its target linears swapped for their
RTN quantize-dequantize, then put back) and `probe_warning` (the one-line verdict). It runs only
where the step measures perplexity (held-out tokens from --eval-data or the calibration text's
held-out part): it costs one more perplexity pass and, while it runs, one copy of the target
linears' weights.
"""

from __future__ import annotations

from typing import Callable

import torch

from llmctl.compress.quant.rtn import quantize_rtn
from llmctl.models.linears import compressible_linears, weights_root
from llmctl.runtime.formats.spec import QuantSpec


def rtn_probe(
    model: torch.nn.Module,
    spec: QuantSpec,
    ignored: Callable[[str], bool],
    score: Callable[[torch.nn.Module], float | None],
    *,
    mse: bool,
) -> float | None:
    """score(model) with every decoder linear not `ignored` RTN-quantized with `spec` (mse: the
    MSE range search); the model's weights are exactly as before when it returns."""
    saved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    try:
        with torch.no_grad():
            root = weights_root(model)
            for name, _, _ in compressible_linears(root):
                if ignored(name):
                    continue
                weight = root.get_submodule(name).weight
                w = weight.detach().float().cpu()
                q = quantize_rtn(w, spec.for_width(name, w.shape[1]), mse=mse).weight
                saved.append((weight, weight.detach().clone()))
                weight.copy_(q.to(weight.device, weight.dtype))
        return score(model)
    finally:
        with torch.no_grad():
            for weight, original in saved:
                weight.copy_(original)


def probe_warning(method: str, after: float | None, probe: float | None) -> str | None:
    """The warning when the method's held-out perplexity is worse than the RTN probe's."""
    if after is None or probe is None or not after > probe:
        return None
    return (
        f"{method.upper()} scored held-out perplexity {after:.4g}, worse than the "
        f"{probe:.4g} round-to-nearest reaches with the same settings on the same tokens: "
        "the calibration data may not match the text (try other --calib data, or --rtn)"
    )
