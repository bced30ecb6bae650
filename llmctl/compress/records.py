"""What each compressed linear reports: the records the calibration driver collects and checkpoints.

Owns: `LinearRecord` (quantize), `LayerSparsity` (sparsify) and `relative_output_error`, the
error measure both report. Plain dataclasses below the methods, so checkpoints.py can rebuild them
without importing the methods.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.runtime.formats.spec import QuantResult


@dataclass
class LinearRecord:
    name: str
    shape: tuple[int, int]
    result: QuantResult
    error: float  # relative output error on the calibration inputs, see relative_output_error
    alpha: float | None = None  # AWQ: the chosen scale exponent for this linear's group

    def to_dict(self) -> dict:
        d = {"name": self.name, "shape": list(self.shape), "rel_output_error": round(self.error, 8)}
        if self.alpha is not None:
            d["awq_alpha"] = self.alpha
        return d


def relative_output_error(w: torch.Tensor, q: torch.Tensor, H: torch.Tensor) -> float:
    """||X (W - Q)^T||^2 / ||X W^T||^2 over the calibration tokens, from H = 2 X X^T / n; w, q [out,
    in]."""
    d = w.float() - q.float()
    num = torch.einsum("oi,ij,oj->", d, H, d)
    den = torch.einsum("oi,ij,oj->", w.float(), H, w.float())
    return float(num / den) if float(den) > 0 else 0.0


@dataclass
class LayerSparsity:
    name: str  # e.g. model.layers.0.mlp.down_proj
    shape: tuple[int, int]  # (out_features, in_features)
    sparsity: float  # fraction of exact zeros after pruning
    pattern_ok: bool  # every group satisfies N:M (always True for unstructured)
    loss: float | None = None  # SparseGPT's OBS error estimate, None for the others
    rel_error: float | None = (
        None  # ||X(W-W')^T||^2 / ||XW^T||^2 on calibration inputs; None without data
    )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "sparsity": round(self.sparsity, 6),
            "pattern_ok": self.pattern_ok,
            **({"obs_loss": self.loss} if self.loss is not None else {}),
            **(
                {"rel_output_error": round(self.rel_error, 8)} if self.rel_error is not None else {}
            ),
        }
