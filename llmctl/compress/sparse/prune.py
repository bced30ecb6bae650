"""One entry point per linear layer: choose the method, prune, and say what was reached.

Owns: `METHODS`, `needs_calibration`, `prune_linear` (called by the layer-by-layer calibration
driver's per-linear callback, or directly for magnitude pruning) and `LayerSparsity`, the per-layer
line of the sparsify report.
"""

from __future__ import annotations

import torch

from llmctl.compress.args import PRUNE_METHODS
from llmctl.compress.hessian import damped_cholesky_inverse, dead_inputs
from llmctl.compress.records import LayerSparsity, relative_output_error
from llmctl.compress.sparse.magnitude import magnitude_mask
from llmctl.compress.sparse.masks import SparsityPattern, apply_mask, zero_fraction
from llmctl.compress.sparse.sparsegpt import sparsegpt_prune
from llmctl.compress.sparse.wanda import input_norms_from_hessian, wanda_mask
from llmctl.runtime.semi_structured import satisfies_nm

METHODS = PRUNE_METHODS


def needs_calibration(method: str) -> bool:
    """Magnitude pruning looks at weights only; Wanda and SparseGPT need the layer's inputs."""
    return method != "magnitude"


def prune_linear(
    name: str,
    weight: torch.Tensor,
    pattern: SparsityPattern,
    method: str,
    hessian: torch.Tensor | None = None,
    *,
    input_norms: torch.Tensor | None = None,
    dampening: float = 0.01,
    column_block: int = 128,
) -> tuple[torch.Tensor, LayerSparsity]:
    """Prune `weight` [out, in] -> (new weight in weight's dtype and device, report line).

    hessian: H [in, in] = 2 X X^T / T of the layer's inputs; required for sparsegpt. Wanda takes
    `input_norms` [in] (||X_j||) or, failing that, sqrt(diag H). Inputs that never fired (zero norm)
    get their columns zeroed, as GPTQ does: they cannot affect the output on the calibration data.
    Computes on weight's device; returns the new weight in weight's dtype.
    """
    if method not in METHODS:
        raise ValueError(f"unknown pruning method {method!r}")
    loss = rel_error = None
    w = weight.detach().float()
    if method == "magnitude":
        new = apply_mask(w, magnitude_mask(w, pattern, scope="layer"))
    elif method == "wanda":
        if input_norms is None and hessian is None:
            raise ValueError(
                f"{name}: wanda needs the input norms (or the Hessian) of the layer's inputs"
            )
        norms = (input_norms if input_norms is not None else input_norms_from_hessian(hessian)).to(
            w.device
        )
        w = _zero_dead_columns(w, norms == 0)
        new = apply_mask(w, wanda_mask(w, norms, pattern))
        if hessian is not None:
            rel_error = relative_output_error(
                weight.detach().float(), new, hessian.to(w.device).float()
            )
    else:
        if hessian is None:
            raise ValueError(f"{name}: sparsegpt needs the Hessian of the layer's inputs")
        h = hessian.to(w.device)
        w = _zero_dead_columns(w, dead_inputs(h))
        u = damped_cholesky_inverse(h, dampening)
        res = sparsegpt_prune(w, u, pattern, column_block=column_block)
        new, loss = res.weight, res.loss
        rel_error = relative_output_error(weight.detach().float(), new, h.float())
    structured = pattern.structured
    ok = satisfies_nm(new, pattern.n, pattern.m) if structured else True  # type: ignore[arg-type]
    line = LayerSparsity(
        name, (int(w.shape[0]), int(w.shape[1])), zero_fraction(new), ok, loss, rel_error
    )
    return new.to(weight.dtype), line


def _zero_dead_columns(w: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """w [out, in] with the columns of never-active inputs set to zero (a copy when any are)."""
    if not bool(dead.any()):
        return w
    w = w.clone()
    w[:, dead] = 0.0
    return w
