"""Log-probabilities of chosen tokens and their top alternatives, computed only when asked.

Owns: `Entry` (one position: the token scored, its logprob and rank, the top-k ids and logprobs),
`score` (a batch of logits rows to entries), the sampled tokens' entries of a step
(`add_sampled`), the prompt's entries from its positions' hidden states (`add_prompt`), and
the conversion to vLLM's `{token_id: Logprob}` dicts. Logprobs are those of the model's raw
distribution (log_softmax of the logits, before penalties and temperature), as vLLM's default
`raw_logprobs` mode reports them.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from llmctl.engine.params import Logprob, PositionLogprobs
from llmctl.engine.sequence import Sequence

PROMPT_ROWS = 512  # prompt positions projected to the vocabulary at a time (memory: rows x V)


class Entry(NamedTuple):
    token_id: int
    logprob: float
    rank: int  # 1 + the number of tokens strictly more likely
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


def score(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[Entry]:
    """logits [R, V] (float32), the token each row scores and how many alternatives it keeps."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    t = torch.tensor(targets, dtype=torch.long, device=lp.device)[:, None]  # [R, 1]
    chosen = lp.gather(1, t)  # [R, 1]
    ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
    kmax = min(max(ks, default=0), lp.shape[1])
    top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (lp[:, :0], lp[:, :0].long())
    top_v, top_i, chosen_l = top_v.tolist(), top_i.tolist(), chosen[:, 0].tolist()
    return [
        Entry(targets[r], chosen_l[r], ranks[r], tuple(top_i[r][: ks[r]]), tuple(top_v[r][: ks[r]]))
        for r in range(len(targets))
    ]


def add_sampled(logits: torch.Tensor, seqs: list[Sequence], tokens: list[list[int]]) -> None:
    """Append the entries of this step's new tokens to each asking sequence's `logprobs`.
    logits: 1 + len(spec_token_ids) rows per sequence (a verified draft j is scored by row j,
    the target model's distribution there)."""
    rows, targets, ks, owners = [], [], [], []
    row = 0
    for seq, new in zip(seqs, tokens):
        if seq.logprobs is not None:
            for j, t in enumerate(new):
                rows.append(row + j)
                targets.append(t)
                ks.append(seq.params.logprobs)
                owners.append(seq)
        row += len(seq.spec_token_ids) + 1
    if not rows:
        return
    for seq, entry in zip(owners, score(logits[rows], targets, ks)):
        seq.logprobs.append(entry)


def add_prompt(
    project: Callable[[torch.Tensor], torch.Tensor], seq: Sequence, first: int, hidden: torch.Tensor
) -> None:
    """Entries for the prompt tokens that positions first.. (hidden [m, H]) predict, appended to
    seq.prompt_logprobs; `project` maps hidden rows to float32 logits."""
    k = seq.params.prompt_logprobs
    for i in range(0, hidden.shape[0], PROMPT_ROWS):
        h = hidden[i : i + PROMPT_ROWS]
        targets = seq.token_ids[first + i + 1 : first + i + 1 + h.shape[0]]
        seq.prompt_logprobs.extend(score(project(h).cpu(), targets, [k] * len(targets)))


def to_dicts(entries: list[Entry], decode: Callable[[list[int]], str]) -> list[PositionLogprobs]:
    """vLLM's shape: per position, the scored token first, then the top alternatives by rank."""
    out = []
    for e in entries:
        d: PositionLogprobs = {e.token_id: Logprob(e.logprob, e.rank, decode([e.token_id]))}
        for j, (tid, lp) in enumerate(zip(e.top_ids, e.top_logprobs)):
            if tid not in d:
                d[tid] = Logprob(lp, j + 1, decode([tid]))
        out.append(d)
    return out
