"""2:4 weights on NVIDIA GPUs through PyTorch's semi-structured sparsity, where measured faster.

Owns: the capability guard (`semi_structured_support`), the per-shape dense-vs-sparse timing
(`time_dense_vs_sparse`), `accelerate_2of4` (swap each 2:4 linear's weight for a
`SparseSemiStructuredTensor` when its shape measured faster sparse, keep it dense otherwise), and
`satisfies_nm`, the N:M rule the pruning code checks too. The benchmark is
benchmarks/bench_semi_structured.py (run by benchmarks/gpu_check.sh).

Honest expectations: no sparse speedup exists on the CPU (pruned weights are stored and multiplied
densely). On the GPU "up to 2x" is the matmul-kernel ceiling for large, compatible GEMMs only;
end-to-end gains measured elsewhere are near 1.1x, and at small batch sizes the dense matmul often
wins. vLLM removed its 2:4 sparse kernels in 2026, so a checkpoint from here runs dense there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch

MIN_CAPABILITY = (8, 0)  # Ampere: the first generation with sparse tensor cores
SHAPE_MULTIPLE = 64  # conservative over cuSPARSELt (16) and CUTLASS (32 x 64) minimum blocks


def satisfies_nm(weight: torch.Tensor, n: int, m: int) -> bool:
    """True when every group of `m` consecutive columns of every row holds at least m-n exact
    zeros."""
    rows, cols = weight.shape
    if cols % m:
        return False
    zeros = (weight.reshape(rows, cols // m, m) == 0).sum(-1)  # [rows, groups]
    return bool((zeros >= m - n).all().item())


@dataclass
class SemiStructuredDecision:
    name: str
    shape: tuple[int, int]
    dense_ms: float | None
    sparse_ms: float | None
    converted: bool
    reason: str


def semi_structured_support(device: str | torch.device) -> tuple[bool, str]:
    """(usable, why not): CUDA, compute capability >= 8.0, and this PyTorch's torch.sparse API."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return (
            False,
            "2:4 sparse matmuls need an NVIDIA GPU; on the CPU pruned weights run dense (no "
            "speedup)",
        )
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    cap = torch.cuda.get_device_capability(dev)
    if cap < MIN_CAPABILITY:
        return (
            False,
            f"GPU compute capability {cap[0]}.{cap[1]} has no sparse tensor cores (needs 8.0+)",
        )
    if not hasattr(torch.sparse, "to_sparse_semi_structured"):
        return False, "this PyTorch build has no torch.sparse.to_sparse_semi_structured"
    return True, ""


def shape_supported(weight: torch.Tensor) -> bool:
    """2-D half-precision weight whose sides are multiples of SHAPE_MULTIPLE and which is exactly
    2:4."""
    return (
        weight.dim() == 2
        and weight.dtype in (torch.float16, torch.bfloat16)
        and weight.shape[0] % SHAPE_MULTIPLE == 0
        and weight.shape[1] % SHAPE_MULTIPLE == 0
        and satisfies_nm(weight, 2, 4)
    )


def _cuda_ms(fn: Callable[[], torch.Tensor], iters: int) -> float:
    for _ in range(3):  # warm-up: cuSPARSELt plans, allocator
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_dense_vs_sparse(weight: torch.Tensor, tokens: int, iters: int = 50) -> tuple[float, float]:
    """Milliseconds of x [tokens, in] @ weight^T dense and 2:4 sparse, on weight's CUDA device."""
    from torch.sparse import to_sparse_semi_structured

    x = torch.randn(tokens, weight.shape[1], dtype=weight.dtype, device=weight.device)
    sparse_w = to_sparse_semi_structured(weight.contiguous())
    with torch.no_grad():
        dense_ms = _cuda_ms(lambda: torch.nn.functional.linear(x, weight), iters)
        sparse_ms = _cuda_ms(lambda: torch.nn.functional.linear(x, sparse_w), iters)
    return dense_ms, sparse_ms


def accelerate_2of4(
    model: torch.nn.Module,
    names: list[str],
    tokens: int = 256,
    min_gain: float = 1.05,
    timer: Callable[[torch.Tensor, int], tuple[float, float]] = time_dense_vs_sparse,
) -> list[SemiStructuredDecision]:
    """Swap the weights of the named 2:4 linears to semi-structured sparse where `timer` says the
    sparse matmul is at least `min_gain` times faster at `tokens` rows; each shape is timed once.

    Returns one decision per name; does nothing (all dense, reason given) off CUDA or below Ampere.
    """
    modules = dict(model.named_modules())
    first = next(model.parameters())
    ok, why = semi_structured_support(first.device)
    if not ok:
        return [
            SemiStructuredDecision(n, tuple(modules[n].weight.shape), None, None, False, why)
            for n in names
        ]
    from torch.sparse import to_sparse_semi_structured

    timings: dict[tuple[int, int], tuple[float, float]] = {}
    decisions = []
    for name in names:
        w = modules[name].weight
        shape = (int(w.shape[0]), int(w.shape[1]))
        if not shape_supported(w):
            decisions.append(
                SemiStructuredDecision(
                    name, shape, None, None, False, "not 2:4, or shape/dtype unsupported"
                )
            )
            continue
        if shape not in timings:
            timings[shape] = timer(w.detach(), tokens)
        dense_ms, sparse_ms = timings[shape]
        faster = dense_ms >= min_gain * sparse_ms
        if faster:
            modules[name].weight = torch.nn.Parameter(
                to_sparse_semi_structured(w.detach().contiguous()), requires_grad=False
            )
        reason = "sparse measured faster" if faster else "dense measured faster or equal"
        decisions.append(SemiStructuredDecision(name, shape, dense_ms, sparse_ms, faster, reason))
    return decisions


def accelerate_from_config(
    model: torch.nn.Module,
    raw_config: dict,
    tokens: int = 256,
    timer: Callable[[torch.Tensor, int], tuple[float, float]] = time_dense_vs_sparse,
) -> list[SemiStructuredDecision]:
    """Engine hook: for a checkpoint whose config.json says `sparsity_config.pattern == "2:4"`, try
    the semi-structured path on its pruned linears (see accelerate_2of4); otherwise do nothing."""
    meta = raw_config.get("sparsity_config") or {}
    if meta.get("pattern") != "2:4" or not meta.get("layers"):
        return []
    modules = dict(model.named_modules())
    names = [n for n in meta["layers"] if isinstance(modules.get(n), torch.nn.Linear)]
    return accelerate_2of4(model, names, tokens=tokens, timer=timer)


def decisions_to_dicts(decisions: list[SemiStructuredDecision]) -> list[dict]:
    return [asdict(d) for d in decisions]
