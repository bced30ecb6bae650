"""Perplexity with a sliding window, and mean per-token KL(reference || model): reusable by eval,
quantize, sparsify and distill reports.

Owns: the window plan and the scoring. Which tokens are scored (Hugging Face's strided perplexity):
windows begin at 0, stride, 2 x stride, ...; a window covers tokens [begin, end) with
end = min(begin + seq_len, N) and scores the tokens t in [max(prev_end, begin + 1), end), where
prev_end is the previous window's end (0 for the first). Each scored token is predicted from the
tokens [begin, t) of its own window, so with stride < seq_len every scored token after the first
window sees at least seq_len - stride tokens of context. The plan stops after the window reaching N.
Result: every token except the very first is scored exactly once when stride < seq_len; when
stride == seq_len (non-overlapping windows) the first token of each window is not scored either,
exactly as Hugging Face's loop does. The model only needs `forward_dense(ids [B, S]) -> logits [B, S, V]`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from llmctl.errors import UsageError


@dataclass(frozen=True)
class Window:
    begin: int  # first token fed to the model
    end: int  # one past the last token fed
    score_from: int  # first scored token; tokens [score_from, end) are scored


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float  # exp(mean_nll)
    mean_nll: float  # nats per scored token
    num_scored_tokens: int
    num_tokens: int
    num_windows: int
    seq_len: int
    stride: int
    mean_kl: float | None  # mean over scored tokens of KL(reference || model), nats; None without a reference
    reference_perplexity: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_windows(num_tokens: int, seq_len: int, stride: int) -> list[Window]:
    """The windows and the tokens each one scores (see module docstring)."""
    if seq_len < 2:
        raise UsageError(f"--seq-len must be at least 2, got {seq_len}")
    if not 1 <= stride <= seq_len:
        raise UsageError(f"--stride must be between 1 and --seq-len ({seq_len}), got {stride}")
    if num_tokens < 2:
        raise UsageError(f"the data has {num_tokens} token(s); perplexity needs at least 2")
    windows, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + seq_len, num_tokens)
        windows.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == num_tokens:
            break
    return windows


def _log_probs(model: Any, ids: Any) -> Any:
    """ids [S] -> log-softmax of the logits [S, V] in float32."""
    import torch

    logits = model.forward_dense(ids[None, :])[0]  # [S, V]
    return torch.log_softmax(logits.float(), dim=-1)


def score_window(model: Any, ids: Any, window: Window, reference: Any | None = None) -> tuple[float, float | None, float | None, int]:
    """(sum of NLL, sum of KL(ref || model), sum of reference NLL, scored count) over one window's scored tokens."""
    import torch

    chunk = ids[window.begin: window.end]  # [S]
    first = window.score_from - window.begin  # index in the chunk of the first scored token
    targets = chunk[first:]  # [n]
    logp = _log_probs(model, chunk)[first - 1: -1]  # [n, V]: position t-1 predicts token t
    nll = -logp.gather(-1, targets[:, None]).sum().item()
    if reference is None:
        return nll, None, None, targets.numel()
    ref_logp = _log_probs(reference, chunk)[first - 1: -1]  # [n, V]
    if ref_logp.shape[-1] != logp.shape[-1]:
        raise UsageError(f"the reference model's vocabulary ({ref_logp.shape[-1]}) differs from the model's ({logp.shape[-1]})")
    kl = torch.nn.functional.kl_div(logp, ref_logp, reduction="sum", log_target=True).item()  # sum p_ref (log p_ref - log p)
    ref_nll = -ref_logp.gather(-1, targets[:, None]).sum().item()
    return nll, kl, ref_nll, targets.numel()


def perplexity(model: Any, token_ids: Sequence[int] | Any, seq_len: int = 512, stride: int | None = None,
               reference: Any | None = None, progress: Callable[[int, int], None] | None = None) -> PerplexityResult:
    """Sliding-window perplexity of `model` on `token_ids` (and KL against `reference`, when given).

    stride None: seq_len // 2. Runs under inference mode on the model's device."""
    import torch

    stride = max(1, seq_len // 2) if stride is None else stride
    device = next(model.parameters()).device
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1).to(device)  # [N]
    windows = plan_windows(ids.numel(), seq_len, stride)
    total_nll = total_kl = total_ref = 0.0
    count = 0
    with torch.inference_mode():
        for i, window in enumerate(windows):
            nll, kl, ref_nll, n = score_window(model, ids, window, reference)
            total_nll += nll
            count += n
            if reference is not None:
                total_kl += kl
                total_ref += ref_nll
            if progress:
                progress(i + 1, len(windows))
    mean_nll = total_nll / count
    return PerplexityResult(
        perplexity=math.exp(mean_nll), mean_nll=mean_nll, num_scored_tokens=count, num_tokens=ids.numel(),
        num_windows=len(windows), seq_len=seq_len, stride=stride,
        mean_kl=None if reference is None else total_kl / count,
        reference_perplexity=None if reference is None else math.exp(total_ref / count),
    )


METHOD = ("sliding window (Hugging Face strided perplexity): windows [begin, min(begin + seq_len, N)) at begin = 0, "
          "stride, ...; each scores tokens [max(previous end, begin + 1), end) given the window's earlier tokens; "
          "perplexity = exp(mean NLL over scored tokens); KL = mean over scored tokens of "
          "sum_v p_ref(v) (log p_ref(v) - log p_model(v)), in nats")
