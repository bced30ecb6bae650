"""A small held-out perplexity for the sparsify report, over `model.forward_dense`.

Owns: `windowed_perplexity` only. It is a stand-in until a shared evaluation helper exists (the
`eval` command's); the measure is the one in the fixtures' train_report.json: non-overlapping
windows of `window` tokens, the first token of each window unscored.
"""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def windowed_perplexity(model, token_ids: torch.Tensor, window: int = 256, batch_size: int = 8) -> float:
    """exp(mean next-token loss) over token_ids [N] cut into windows of `window`; the tail is dropped."""
    ids = token_ids.flatten()
    n_windows = ids.numel() // window
    if n_windows == 0:
        raise ValueError(f"need at least {window} tokens for a perplexity window, got {ids.numel()}")
    device = next(model.parameters()).device
    windows = ids[: n_windows * window].reshape(n_windows, window).to(device)
    total, count = 0.0, 0
    for start in range(0, n_windows, batch_size):
        batch = windows[start : start + batch_size]  # [B, window]
        logits = model.forward_dense(batch)  # [B, window, vocab] float32
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(loss)
        count += batch[:, 1:].numel()
    return math.exp(total / count)
