"""Speculative decoding: proposing draft tokens and verifying them against the target model.

Owns: the n-gram (prompt lookup) and draft-model proposers, and `verify`, the accept/reject rule.
Proposals are deterministic (a point mass on each draft token), so the standard rule reduces to:
accept draft d with probability p(d); on the first rejection, sample from p with d removed and
renormalised; if every draft is accepted, sample one bonus token. The emitted tokens are then
distributed exactly as the target model's own samples. Greedy requests accept while drafts equal
the target's argmax, so their output is identical to decoding without speculation.
"""

from __future__ import annotations

import torch

from llmctl.engine.params import SamplingParams
from llmctl.engine.sampler import greedy, sampling_probs


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from
    `max_n` down to `min_n`) and propose the tokens that followed it."""

    def __init__(self, max_n: int = 3, min_n: int = 1, window: int = 4096):
        self.max_n, self.min_n, self.window = max_n, min_n, window

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        tokens = token_ids[-self.window :]
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = tokens[length - n :]
            for start in range(length - n - 1, -1, -1):  # latest match first
                if tokens[start : start + n] == tail:
                    follow = tokens[start + n : start + n + k]
                    if follow:
                        return follow
        return []

    def release(self, request_id: str) -> None:
        pass


class DraftModelProposer:
    """A smaller model with the same vocabulary proposes k greedy tokens. It keeps its own small
    per-request KV cache (dense, not paged), trimmed back to the longest prefix still valid after
    verification, so each proposal only computes the newly accepted tokens."""

    def __init__(self, model, device: str):
        self.model, self.device = model, device
        self.state: dict[str, tuple[list[int], list]] = {}

    @torch.inference_mode()
    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        cached, cache = self.state.get(request_id, ([], None))
        common = 0
        for a, b in zip(cached, token_ids):
            if a != b:
                break
            common += 1
        common = min(common, len(token_ids) - 1)  # always feed at least the last token
        cache = self.model.trim_cache(cache, common)
        tokens = list(token_ids[:common])
        new = token_ids[common:]
        out: list[int] = []
        for _ in range(k):
            ids = torch.tensor(new, dtype=torch.long, device=self.device)
            logits, cache = self.model.forward_cached(ids, len(tokens), cache)
            tokens.extend(new)
            nxt = int(logits.argmax())
            out.append(nxt)
            new = [nxt]
        self.state[request_id] = (
            tokens,
            cache,
        )  # the last draft has no KV yet: it is not in `tokens`
        return out

    def release(self, request_id: str) -> None:
        self.state.pop(request_id, None)


def verify(
    logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator
) -> list[int]:
    """logits [len(drafts) + 1, V] of the target at the positions that predict each draft and the
    token after them. Returns the accepted drafts followed by one corrected or bonus token."""
    if params.greedy:
        target = greedy(logits).tolist()
        out = []
        for d, t in zip(drafts, target):
            if d != t:
                break
            out.append(d)
        return out + [target[len(out)]]
    probs = sampling_probs(logits, [params] * logits.shape[0])  # [k + 1, V]
    u = torch.rand(len(drafts), generator=generator).tolist()
    out = []
    for i, d in enumerate(drafts):
        if u[i] < float(probs[i, d]):
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # p was a point mass on d: it would have been accepted
            return out + [d]
        return out + [int(torch.multinomial(residual / total, 1, generator=generator))]
    return out + [int(torch.multinomial(probs[len(drafts)], 1, generator=generator))]
