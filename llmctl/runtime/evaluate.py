"""Perplexity with a sliding window, and mean per-token KL(reference || model): reusable by eval and
the quantize and sparsify reports.

Owns: the window plan and the scoring. Which tokens are scored (Hugging Face's strided perplexity):
windows begin at 0, stride, 2 x stride, ...; a window covers tokens [begin, end) with
end = min(begin + seq_len, N) and scores the tokens t in [max(prev_end, begin + 1), end), where
prev_end is the previous window's end (0 for the first). Each scored token is predicted from the
tokens [begin, t) of its own window, so with stride < seq_len every scored token after the first
window sees at least seq_len - stride tokens of context. The plan stops after the window reaching N.
Result: every token except the very first is scored exactly once when stride < seq_len; when
stride == seq_len (non-overlapping windows) the first token of each window is not scored either,
exactly as Hugging Face's loop does. The model only needs
`forward_dense(ids [B, S]) -> logits [B, S, V]`.
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
    mean_kl: (
        float | None
    )  # mean over scored tokens of KL(reference || model), nats; None without a reference
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


LOGITS_BUDGET = (
    2**28
)  # bytes of float32 logits per forward pass; bounds how many windows run together


def _log_probs(model: Any, chunks: Any) -> Any:
    """chunks [B, S] -> log-softmax of the logits [B, S, V] in float32."""
    import torch

    return torch.log_softmax(model.forward_dense(chunks).float(), dim=-1)


def _groups(windows: list[Window], seq_len: int, vocab_size: int) -> list[list[Window]]:
    """Consecutive windows of equal length, at most LOGITS_BUDGET bytes of logits per group."""
    most = max(1, LOGITS_BUDGET // (seq_len * vocab_size * 4))
    groups: list[list[Window]] = []
    for w in windows:
        last = groups[-1] if groups else None
        if last and len(last) < most and last[0].end - last[0].begin == w.end - w.begin:
            last.append(w)
        else:
            groups.append([w])
    return groups


def _score(
    logp: Any, chunk: Any, window: Window, ref_logp: Any | None
) -> tuple[float, float, float, int]:
    """(sum NLL, sum KL(ref || model), sum reference NLL, count) over one window's scored tokens.

    logp, ref_logp [S, V] of the window; chunk [S] its token ids."""
    import torch

    first = window.score_from - window.begin  # index in the chunk of the first scored token
    targets = chunk[first:, None]  # [n, 1]
    lp = logp[first - 1 : -1]  # [n, V]: position t-1 predicts token t
    nll = -lp.gather(-1, targets).sum().item()
    if ref_logp is None:
        return nll, 0.0, 0.0, targets.shape[0]
    rp = ref_logp[first - 1 : -1]  # [n, V]
    kl = torch.nn.functional.kl_div(
        lp, rp, reduction="sum", log_target=True
    ).item()  # sum p_ref (log p_ref - log p)
    return nll, kl, -rp.gather(-1, targets).sum().item(), targets.shape[0]


def perplexity(
    model: Any,
    token_ids: Sequence[int] | Any,
    seq_len: int = 512,
    stride: int | None = None,
    reference: Any | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Sliding-window perplexity of `model` on `token_ids` (and KL against `reference`, when given).

    stride None: seq_len // 2. Runs under inference mode on the model's device; windows of equal
    length run as one batch (bounded by LOGITS_BUDGET)."""
    import torch

    stride = max(1, seq_len // 2) if stride is None else stride
    device = next(model.parameters()).device
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1).to(device)  # [N]
    windows = plan_windows(ids.numel(), seq_len, stride)
    totals = [0.0, 0.0, 0.0, 0]  # NLL, KL, reference NLL, scored tokens
    done = 0
    with torch.inference_mode():
        vocab = model.forward_dense(ids[None, :2]).shape[-1]
        for group in _groups(windows, seq_len, vocab):
            chunks = torch.stack([ids[w.begin : w.end] for w in group])  # [B, S]
            logp = _log_probs(model, chunks)  # [B, S, V]
            ref_logp = None if reference is None else _log_probs(reference, chunks)
            if ref_logp is not None and ref_logp.shape[-1] != logp.shape[-1]:
                raise UsageError(
                    f"the reference model's vocabulary ({ref_logp.shape[-1]}) differs from the "
                    f"model's ({logp.shape[-1]})"
                )
            for j, w in enumerate(group):
                part = _score(logp[j], chunks[j], w, None if ref_logp is None else ref_logp[j])
                totals = [a + b for a, b in zip(totals, part)]
            done += len(group)
            if progress:
                progress(done, len(windows))
    nll, kl, ref_nll, count = totals
    return PerplexityResult(
        perplexity=math.exp(nll / count),
        mean_nll=nll / count,
        num_scored_tokens=count,
        num_tokens=ids.numel(),
        num_windows=len(windows),
        seq_len=seq_len,
        stride=stride,
        mean_kl=None if reference is None else kl / count,
        reference_perplexity=None if reference is None else math.exp(ref_nll / count),
    )


METHOD = (
    "sliding window (Hugging Face strided perplexity): windows [begin, min(begin + seq_len, N)) "
    "at begin = 0, "
    "stride, ...; each scores tokens [max(previous end, begin + 1), end) given the window's "
    "earlier tokens; "
    "perplexity = exp(mean NLL over scored tokens); KL = mean over scored tokens of "
    "sum_v p_ref(v) (log p_ref(v) - log p_model(v)), in nats"
)


HELDOUT_WINDOW = 256  # tokens per window, capped by the model's context
HELDOUT_MAX_TOKENS = 65536
HELDOUT_METHOD = (
    f"llmctl.runtime.evaluate.perplexity, non-overlapping windows of {HELDOUT_WINDOW} tokens"
)


def heldout_perplexity(model: Any, heldout: Any | None) -> float | None:
    """The before/after perplexity quantize and sparsify report: the first HELDOUT_MAX_TOKENS
    held-out tokens in non-overlapping HELDOUT_WINDOW windows, the same for both commands so their
    numbers compare. None when there is nothing to score."""
    if heldout is None or heldout.numel() < 2:
        return None
    window = min(HELDOUT_WINDOW, model.config.max_position_embeddings)
    return perplexity(model, heldout[:HELDOUT_MAX_TOKENS], seq_len=window, stride=window).perplexity
