"""Turns a scheduled batch into tensors, runs the model over the paged KV cache, returns logits.

Owns: the KV cache tensors (sized once from the memory budget) and the per-step input building:
packed token ids [T], positions [T], slot mapping [T], decode block tables, prefill chunks, and
the indices of the tokens whose logits are needed (the last token of each sequence that samples),
and, for requests that asked for prompt logprobs, the hidden states of their prompt positions.
One-token decodes and speculative verification tokens are laid out as decodes (each token its
own context length over the paged cache); steps made only of those go through
`cuda_graphs.DecodeGraphs` when enabled (CUDA). With `EngineConfig.batch_invariant` every token
is laid out as a decode (prefill chunks included) and the model takes its fixed-order paths (on
CUDA the Triton kernels of kernels/cuda/invariant.py), so a token's arithmetic does not depend
on what else is in the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmctl.engine.config import DEFAULT_KV_CAP, EngineConfig
from llmctl.engine.cuda_graphs import DecodeGraphs, graph_sizes
from llmctl.engine.scheduler import ScheduledBatch
from llmctl.engine.sequence import Sequence
from llmctl.errors import UsageError
from llmctl.kernels.attention import (
    GatherWorkspace,
    PagedAttentionMetadata,
    PrefillChunk,
    length_groups,
)
from llmctl.kernels.kv_dtype import cache_dtype, row_width
from llmctl.models.config import ModelConfig
from llmctl.models.prepare import Serving, prepare_for_inference

MIN_GROUPED_DECODES = 8  # below this, one padded decode-attention call costs less than several


@dataclass
class StepInputs:
    """One step as Python lists, in packed order (tokens laid out as decodes first, longest
    context first)."""

    ids: list[int] = field(default_factory=list)  # [T] token ids
    positions: list[int] = field(default_factory=list)  # [T]
    slots: list[int] = field(default_factory=list)  # [T] KV slot of each token
    dec_tables: list[list[int]] = field(
        default_factory=list
    )  # block table of each token laid out as a decode
    dec_lens: list[int] = field(default_factory=list)  # its context length, the new token included
    prefills: list[PrefillChunk] = field(default_factory=list)
    logits_idx: list[int] = field(default_factory=list)  # packed rows whose logits are sampled
    sampling: list[Sequence] = field(default_factory=list)
    # (sequence, first prompt position, packed offset, count): prompt positions to score
    prompt_rows: list[tuple[Sequence, int, int, int]] = field(default_factory=list)
    lora_rows: list[tuple[object, int]] = field(default_factory=list)  # (adapter, tokens) per seq


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of every layer for one token, in cache dtype `dtype` (int8 rows hold a scale)."""
    row = row_width(config.head_dim, dtype)
    return 2 * config.num_layers * config.num_kv_heads * row * dtype.itemsize


def activation_reserve(config: ModelConfig, cfg: EngineConfig, dtype: torch.dtype) -> int:
    """An upper estimate of one step's activation memory, kept free when the KV cache is sized
    from --gpu-memory-utilization: hidden states, q/k/v and the MLP of max_num_batched_tokens
    tokens, and float32 logits [num_seqs, vocab] for sampling (with a copy)."""
    size = torch.empty((), dtype=dtype).element_size()
    per_token = 6 * config.hidden_size + 3 * config.intermediate_size
    logits = 2 * 4 * config.vocab_size * min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
    return cfg.max_num_batched_tokens * per_token * size + logits


def utilization_budget(util: float, total: int, free: int, in_use: int, reserve: int) -> int:
    """KV-cache bytes under vLLM's rule: this process may use `util` of the device's `total`
    memory (weights `in_use` and an activation `reserve` included), and never more than is
    `free` now."""
    return max(0, min(int(util * total) - in_use, free) - reserve)


def _kv_budget(config: ModelConfig, cfg: EngineConfig, device: str, bytes_per_block: int) -> int:
    if cfg.kv_cache_memory is not None:
        return cfg.kv_cache_memory
    if cfg.gpu_memory_utilization is not None and str(device).startswith("cuda"):
        free, total = torch.cuda.mem_get_info(device)
        reserve = activation_reserve(config, cfg, torch.float32)
        in_use = torch.cuda.memory_allocated(device)
        return utilization_budget(cfg.gpu_memory_utilization, total, free, in_use, reserve)
    # enough for max_num_seqs sequences of full length, capped
    max_len = min(
        cfg.max_model_len or config.max_position_embeddings, config.max_position_embeddings
    )
    per_seq = -(-max_len // cfg.block_size) * bytes_per_block
    return min(DEFAULT_KV_CAP, cfg.max_num_seqs * per_seq)


def _triton_importable() -> bool:
    """kernels/cuda/invariant.py imports (triton installed)."""
    try:
        import llmctl.kernels.cuda.invariant  # noqa: F401
    except ImportError:
        return False
    return True


class ModelRunner:
    def __init__(
        self,
        model,
        config: ModelConfig,
        engine_config: EngineConfig,
        device: str,
        dtype: torch.dtype,
    ):
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        # Every token's arithmetic independent of its batch (see _step_inputs, kernels/invariant.py)
        self.batch_invariant = engine_config.batch_invariant
        if self.batch_invariant and device != "cpu":
            if not (str(device).startswith("cuda") and _triton_importable()):
                raise UsageError("batch-invariant runs need the CPU, or CUDA with triton")
        self.kernels = engine_config.kernels
        serving = Serving(
            str(device),
            dtype,
            engine_config.max_num_batched_tokens,
            engine_config.max_num_seqs,
            self.batch_invariant,
            engine_config.max_model_len,
        )
        prepare_for_inference(model, self.kernels, serving)
        self.block_size = engine_config.block_size
        # [kv_heads, slots, D] per layer, K and V, in --kv-cache-dtype (kernels/kv_dtype.py)
        self.cache_dtype = cache_dtype(engine_config.kv_cache_dtype, dtype)
        if self.cache_dtype is torch.int8 and device != "cpu":  # no Triton kernel reads it
            raise UsageError("--kv-cache-dtype int8 runs on the CPU; on a GPU use fp8")
        self.bytes_per_block = kv_bytes_per_token(config, self.cache_dtype) * self.block_size
        budget = _kv_budget(config, engine_config, device, self.bytes_per_block)
        self.num_blocks = budget // self.bytes_per_block
        # One block more than the block manager hands out: padded rows of a captured decode step
        # (cuda_graphs.py) write there.
        self.scratch_block = self.num_blocks
        shape = (
            config.num_kv_heads,
            (self.num_blocks + 1) * self.block_size,
            row_width(config.head_dim, self.cache_dtype),
        )  # head-major
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.cache_dtype, device=device),
                torch.zeros(shape, dtype=self.cache_dtype, device=device),
            )
            for _ in range(config.num_layers)
        ]
        self.workspace = GatherWorkspace()
        self.graphs: DecodeGraphs | None = None
        self.lora = None  # engine/lora.LoraSlots when adapters are served: told each step's rows

    def enable_decode_graphs(
        self, max_num_seqs: int, max_model_len: int, use_graphs: bool = True
    ) -> None:
        """Serve decode-only steps of up to min(max_num_seqs, 256) sequences from static buffers,
        through CUDA graphs (`use_graphs`, CUDA only) or eagerly (the same arithmetic, for
        tests)."""
        max_blocks = min(-(-max_model_len // self.block_size), self.num_blocks)
        self.graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            graph_sizes(max_num_seqs),
            max_blocks,
            self.scratch_block,
            self.block_size,
            self.device,
            use_graphs,
            self.batch_invariant,
        )

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def _as_decodes(self, seq: Sequence, n: int) -> bool:
        """Whether the step's n tokens of seq attend as decodes, each with its own context
        length over the paged cache: one-token decodes, speculative verification (the last
        token and its drafts: reading a short context n times costs less than gathering it for
        chunk attention), and every token in batch-invariant runs."""
        return self.batch_invariant or n == 1 + len(seq.spec_token_ids)

    def _packed_order(self, batch: ScheduledBatch) -> list[tuple[Sequence, int, bool]]:
        """The batch's (sequence, new tokens, laid out as decodes), the decode rows first sorted
        by context length, longest first, so that decode attention can pad each run of similar
        lengths separately; while adapters are served, grouped by adapter first (stable: by
        length within each)."""
        rows = [
            (seq, n, self._as_decodes(seq, n)) for seq, n in zip(batch.seqs, batch.num_new_tokens)
        ]
        decodes = sorted((r for r in rows if r[2]), key=lambda r: -r[0].num_computed_tokens)
        if self.lora is not None:  # each adapter's decode rows one slice (models/lora.py)
            decodes.sort(key=lambda r: "" if r[0].lora is None else r[0].lora.digest)
        return decodes + [r for r in rows if not r[2]]

    def _step_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """The step as Python lists: packed ids, positions and slots, decode rows first."""
        bs = self.block_size
        st = StepInputs()
        for seq, n, as_decodes in self._packed_order(batch):
            start = seq.num_computed_tokens
            table = seq.block_table
            offset = len(st.ids)
            st.ids.extend(seq.step_token_ids(start, n))
            st.positions.extend(range(start, start + n))
            st.slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if as_decodes:
                st.dec_tables.extend([table] * n)
                st.dec_lens.extend(range(start + 1, start + n + 1))
            else:
                seq_slots = [table[p // bs] * bs + p % bs for p in range(start + n)]
                st.prefills.append(
                    PrefillChunk(
                        offset,
                        n,
                        start,
                        torch.tensor(seq_slots, dtype=torch.long, device=self.device),
                    )
                )
            st.lora_rows.append((seq.lora, n))
            if seq.needs_prompt_logprobs:
                _add_prompt_rows(st, seq, start, n, offset)
            k = len(seq.spec_token_ids)
            if (
                start + n == seq.num_tokens + k
            ):  # caught up: logits for the last token and each draft
                st.logits_idx.extend(range(offset + n - 1 - k, offset + n))
                st.sampling.append(seq)
        return st

    def _tensors(self, st: StepInputs):
        """The step's tensors: (input_ids, positions, meta, logits_indices, sampling sequences)."""
        dev, bs = self.device, self.block_size
        nd = len(st.dec_tables)
        if nd:
            width = max(len(t) for t in st.dec_tables)
            padded = [t + [0] * (width - len(t)) for t in st.dec_tables]  # padding is masked out
            dec_tables_t = torch.tensor(padded, dtype=torch.long, device=dev)
            dec_lens_t = torch.tensor(st.dec_lens, dtype=torch.long, device=dev)
        else:
            dec_tables_t = dec_lens_t = None
        grouped = nd >= MIN_GROUPED_DECODES and not self.batch_invariant
        groups = length_groups(st.dec_lens, bs) if grouped else None
        meta = PagedAttentionMetadata(
            torch.tensor(st.slots, dtype=torch.long, device=dev),
            nd,
            dec_tables_t,
            dec_lens_t,
            st.prefills,
            bs,
            groups,
            self.workspace,
            max(st.dec_lens, default=0),
            self.batch_invariant,
        )
        return (
            torch.tensor(st.ids, dtype=torch.long, device=dev),
            torch.tensor(st.positions, dtype=torch.long, device=dev),
            meta,
            torch.tensor(st.logits_idx, dtype=torch.long, device=dev),
            st.sampling,
        )

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden rows [m, H] -> float32 logits [m, V], as the sampled rows are computed."""
        with torch.inference_mode():
            return self.model.compute_logits(hidden, self.batch_invariant)

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """Copy the K/V of block src into block dst, every layer (a forked sequence's own copy
        of a partly filled block it shares with its parent)."""
        bs = self.block_size
        for k, v in self.kv_caches:  # [kv_heads, slots, head_dim]
            k[:, dst * bs : (dst + 1) * bs] = k[:, src * bs : (src + 1) * bs]
            v[:, dst * bs : (dst + 1) * bs] = v[:, src * bs : (src + 1) * bs]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch):
        """Run one step; returns logits on the CPU in the model's dtype (the sampler widens them
        where it computes more than an argmax), 1 + len(spec_token_ids) rows per
        sampling sequence, in order, those sequences, and (sequence, first position, hidden
        [m, H]) for the prompt positions whose logprobs were asked."""
        st = self._step_inputs(batch)
        if self.lora is not None:  # which packed rows take which adapter (no CUDA graphs then)
            self.lora.set_step(st.lora_rows)
        if (
            self.graphs is not None
            and not st.prefills
            and self.graphs.fits(len(st.ids), max(map(len, st.dec_tables)))
        ):
            hidden = self.graphs.run(st.ids, st.positions, st.slots, st.dec_tables, st.dec_lens)
            logits_idx, sampling = (
                torch.tensor(st.logits_idx, dtype=torch.long, device=self.device),
                st.sampling,
            )
        else:
            input_ids, positions, meta, logits_idx, sampling = self._tensors(st)
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
        prompt = [(seq, p, hidden[o : o + m]) for seq, p, o, m in st.prompt_rows]
        if not sampling:
            return torch.empty(0, self.config.vocab_size), sampling, prompt
        logits = self.model.compute_logits(hidden[logits_idx], self.batch_invariant, float32=False)
        return logits.cpu(), sampling, prompt


def _add_prompt_rows(st: StepInputs, seq: Sequence, start: int, n: int, offset: int) -> None:
    """The positions of this chunk that predict a prompt token not scored yet: position p
    predicts token p + 1; the first len(seq.prompt_logprobs) were scored before a preemption."""
    first = max(start, len(seq.prompt_logprobs))
    end = min(start + n, seq.num_prompt_tokens - 1)
    if end > first:
        st.prompt_rows.append((seq, first, offset + first - start, end - first))
