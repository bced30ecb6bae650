"""Continuous batching: which sequences compute how many tokens in the next step.

Owns: the waiting and running queues, the per-step token budget (chunked prefill), admission with
prefix-cache hits (a LoRA request admitted only once its adapter has a slot: `lora_gate`), and
preemption by recompute when KV blocks run out. Plain Python, no tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from llmctl.engine.block_manager import BlockManager
from llmctl.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """Sequences to run this step with their token counts; one-token decodes are listed first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # LoRA (engine/lora.py): whether a waiting sequence's adapter can be made resident beside
        # the running ones' (loading it where so); None: no adapters
        self.lora_gate: Callable[[Sequence, list[Sequence]], bool] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = seq.num_tokens - seq.num_computed_tokens
            if seq.spec_token_ids and n + len(seq.spec_token_ids) <= budget:
                n += len(seq.spec_token_ids)
            else:
                seq.spec_token_ids = []
                n = min(n, budget)
            while not self.bm.allocate(seq, n):
                victim = self.running.pop()  # the latest admitted gives way
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                # Draft tokens may be rejected: only verified tokens enter the prefix cache.
                self.bm.cache_full_blocks(
                    seq, seq.num_computed_tokens + n - len(seq.spec_token_ids)
                )
                chosen.append((seq, n))
                budget -= n
                i += 1
        if not preempted:  # admit new work only when running requests are not short of blocks
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                if seq.lora is not None and not self.lora_gate(seq, self.running):
                    break  # every adapter slot is held by running requests: wait, in order
                # a hit would skip positions whose prompt logprobs are asked: compute them all
                cached = [] if seq.needs_prompt_logprobs else self.bm.find_cached_prefix(seq)
                computed = len(cached) * self.bm.block_size
                n = min(seq.num_tokens - computed, budget)
                if not self.bm.allocate(seq, n, cached):
                    break
                seq.num_computed_tokens = computed
                if not seq.needs_prompt_logprobs:
                    self.bm.count_lookup(seq.num_tokens, computed)
                self.bm.cache_full_blocks(seq, computed + n)
                seq.status = Status.RUNNING
                self.waiting.popleft()
                self.running.append(seq)
                chosen.append((seq, n))
                budget -= n
        chosen.sort(key=lambda sn: sn[1] != 1)  # stable: decodes first, then chunks, in queue order
        return ScheduledBatch([s for s, _ in chosen], [n for _, n in chosen], preempted)

    def fork(self, parent: Sequence, children: list[Sequence]) -> list[tuple[int, int]]:
        """Run `children` (copies of `parent`, which has just computed its prompt) on its K/V
        (block_manager.fork); returns the (source, destination) blocks whose K/V to copy."""
        copies = []
        for child in children:
            pair = self.bm.fork(parent, child)
            if pair is not None:
                copies.append(pair)
            child.status = Status.RUNNING
            self.running.append(child)
        return copies

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.spec_token_ids = []
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.bm.free(seq)
        self.running.remove(seq)
