"""On-policy batches of distill (GKD / MiniLLM): the student continues prompts through our engine.

Owns: `is_on_policy` (which optimizer steps sample: a pure function of the seed and the step, so a
resumed run picks the same ones), `prompt_length` (where a packed sequence's prompt ends) and
`student_samples`, which builds an `LLMEngine` around the student's current weights (as
runtime/loader.py's Runtime.start_engine does), lets it sample the rest of every sequence at
temperature 1 with a seed per step and row, and returns the new ids with a mask of the generated
tokens. A fresh engine per call: its KV cache (sized for this batch only), prefix cache and the
packed lm_head copy (model_runner.py packs one on the CPU in float32) would otherwise hold what
older weights computed; the packed copy is dropped afterwards so nothing outlives the call.
"""

from __future__ import annotations

import random

import torch

ENGINE_BLOCK = 16  # KV block size of the sampling engine


def is_on_policy(seed: int, step: int, fraction: float) -> bool:
    """Whether optimizer step `step` (0-based) samples its sequences from the student."""
    if fraction <= 0:
        return False
    return random.Random(f"llmctl-on-policy:{seed}:{step}").random() < fraction


def prompt_length(mask: torch.Tensor) -> int:
    """Tokens kept as the prompt of a packed sequence with target mask [S]: those before its first
    target when a prompt (prompt + completion, or chat) starts it, else the first half."""
    s = mask.shape[0]
    targets = torch.nonzero(mask).flatten()
    first = int(targets[0]) if targets.numel() else 0
    return first if 0 < first < s - 1 else s // 2


def sample_seed(seed: int, step: int, row: int) -> int:
    """The sampling seed of row `row` of step `step` (the same on every rank and after resume)."""
    return random.Random(f"llmctl-sample:{seed}:{step}:{row}").getrandbits(63)


def kv_budget(config, rows: int, seq_len: int, dtype: torch.dtype) -> int:
    """KV bytes for `rows` sequences of seq_len tokens, one spare block each: nothing preempted."""
    from llmctl.engine.model_runner import kv_bytes_per_token

    blocks = rows * (-(-seq_len // ENGINE_BLOCK) + 1)
    return blocks * ENGINE_BLOCK * kv_bytes_per_token(config, dtype)


def build_engine(student, rows: int, seq_len: int, eos_ids: tuple[int, ...]):
    """An engine over the student's live parameters (no copy), its KV cache for `rows` sequences."""
    from llmctl.engine.config import EngineConfig
    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.kernels.config import KernelConfig

    weight = next(student.parameters())
    cfg = EngineConfig(
        block_size=ENGINE_BLOCK,
        kv_cache_memory=kv_budget(student.config, rows, seq_len, weight.dtype),
        enable_prefix_caching=False,  # cached blocks would hold K/V of older weights
        max_num_seqs=rows,
        max_model_len=seq_len,
        cuda_graphs=False,  # a capture per step would cost more than the step
        # Merging would replace the parameters the optimizer holds with views of a new tensor;
        # timing kernels per step would cost more than the step.
        kernels=KernelConfig(autotune=False, merge_linears=False),
    )
    return LLMEngine(student, student.config, cfg, eos_token_ids=eos_ids, device=str(weight.device))


def student_samples(
    student, ids: torch.Tensor, mask: torch.Tensor, seed: int, step: int, row0: int,
    eos_ids: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """ids [B, S] and mask [B, S] of a micro-batch -> (ids [B, S] with each row's prompt followed
    by what the student sampled, mask [B, S] true on the generated tokens only). A row that stops
    at an end-of-sequence token early is padded with that token, masked out; `row0` numbers the
    rows across micro-batches and ranks for their seeds."""
    from llmctl.engine.params import SamplingParams
    from llmctl.models.prepare import drop_weight_copies

    b, s = ids.shape
    engine = build_engine(student, b, s, eos_ids)
    prompts = [prompt_length(mask[r]) for r in range(b)]
    try:
        for r in range(b):
            params = SamplingParams(
                max_tokens=s - prompts[r], temperature=1.0, seed=sample_seed(seed, step, row0 + r)
            )
            engine.add_request(str(r), ids[r, : prompts[r]].tolist(), params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[int(out.request_id)] = out.output_token_ids
    finally:
        drop_weight_copies(student)  # the engine's packed copies go stale at the next step
    new_ids, new_mask = ids.clone(), torch.zeros_like(mask)
    for r in range(b):
        p, gen = prompts[r], done[r][: s - prompts[r]]
        new_ids[r, p : p + len(gen)] = torch.tensor(gen, dtype=ids.dtype)
        new_ids[r, p + len(gen) :] = gen[-1]
        new_mask[r, p : p + len(gen)] = True
    return new_ids, new_mask
