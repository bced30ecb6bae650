"""Choosing the next token for every sequence of a step, on tensors for the whole batch.

Owns: penalties (repetition, presence, frequency), temperature, top-k, top-p, min-p and the draw.
Seeded requests draw from their own generator, so their output does not depend on batch-mates.
"""

from __future__ import annotations

import torch

from llmctl.engine.sequence import Sequence
from llmctl.kernels.cpu import elementwise


class Sampler:
    def __init__(self, seed: int | None = None, native: bool = True):
        self.native = native  # KernelConfig.native: the C argmax may serve greedy rows
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits [B, V] (one row per sequence; float32 or the model's dtype, widened to float32
        wherever more than an argmax is computed) -> B token ids."""
        params = [s.params for s in seqs]
        if any(
            p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params
        ):
            logits = apply_penalties(logits.to(torch.float32, copy=True), seqs)
        if all(p.greedy for p in params):
            return greedy(logits, self.native).tolist()
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        probs = sampling_probs(logits, params)
        tokens = self._draw(probs, seqs)
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=logits.device)
            tokens[rows] = greedy(logits[rows], self.native)
        return tokens.tolist()

    def _draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One token per row of probs [B, V] by inverse CDF: a uniform draw per row, located in the
        row's cumulative sum. One random number per row instead of V (the exponential-race trick
        measured 57 ms per step at 16 x 152k on the CPU, mostly drawing its noise; this about
        20)."""
        u = torch.rand(probs.shape[0], dtype=torch.float64, generator=self.generator)
        for i, s in enumerate(seqs):
            if s.params.seed is not None and not s.params.greedy:
                if s.generator is None:
                    s.generator = torch.Generator().manual_seed(s.params.seed)
                u[i] = torch.rand(1, dtype=torch.float64, generator=s.generator)[0]
        cdf = probs.to(torch.float64).cumsum(dim=-1)  # float64: 152k float32 terms lose ~1e-4
        u = (u.to(probs.device) * cdf[:, -1] * (1 - 1e-12))[:, None]  # strictly below each total
        return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=probs.shape[1] - 1)


def greedy(logits: torch.Tensor, native: bool = True) -> torch.Tensor:
    """logits [B, V] (float32 or the model's dtype) -> [B]: the first index of each row's maximum,
    as argmax gives it (the same index on ties and NaNs, tests/test_sampling.py). On the CPU
    through the C kernel (kernels/cpu/csrc/cpu_argmax.c) where `native` and it is built, else
    torch.max's indices (on the CPU about twice as fast as argmax)."""
    if native and elementwise.use_argmax(logits):
        return elementwise.argmax(logits)
    return logits.max(dim=-1).indices


def sampling_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied: the distribution each row samples from,
    [B, V] float32 (logits of any float dtype, widened here)."""
    temps = torch.tensor(
        [p.temperature if not p.greedy else 1.0 for p in params], dtype=torch.float32
    )
    logits = logits.float() / temps[:, None].to(logits.device)
    probs = torch.softmax(apply_top_k_top_p(logits, params), dim=-1)
    min_ps = [p.min_p for p in params]
    if any(min_ps):
        mp = torch.tensor(min_ps, dtype=probs.dtype, device=probs.device)[:, None]
        probs = torch.where(probs < mp * probs.amax(dim=-1, keepdim=True), 0.0, probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (as in HF/vLLM); presence and frequency
    penalties over output tokens only (as in OpenAI/vLLM). logits [B, V] modified in place."""
    vocab = logits.shape[1]
    for i, s in enumerate(seqs):
        p = s.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(s.token_ids)), dtype=torch.long, device=logits.device)
            seen = seen[seen < vocab]
            row = logits[i, seen]
            logits[i, seen] = torch.where(
                row > 0, row / p.repetition_penalty, row * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and s.num_output_tokens:
            out = torch.tensor(s.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
                logits.dtype
            )
    return logits


def apply_top_k_top_p(logits: torch.Tensor, params) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p nucleus. logits [B, V]."""
    vocab = logits.shape[1]
    ks = [min(p.top_k, vocab) if p.top_k else vocab for p in params]
    ps = [p.top_p for p in params]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor(ks, device=logits.device)[:, None]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly ahead of each token
    top_p = torch.tensor(ps, dtype=probs.dtype, device=logits.device)[:, None]
    sorted_logits = sorted_logits.masked_fill((before >= top_p) & (ranks > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
