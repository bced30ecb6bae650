"""CUDA graphs for decode-only steps: the model forward captured once per padded batch size,
replayed.

Owns: the static input buffers a captured step reads (token ids, positions, slot mapping, block
tables, context lengths), the padding of a batch up to the next captured size, the captured
graphs, and `graphs_supported` (which models and devices may use them; the engine also keeps
them off when it serves LoRA adapters, whose per-step segments a graph would freeze). A decode
step of a small model launches hundreds of kernels whose launch time exceeds their run time on a
large GPU; a replay launches them as one.

Padded rows write their K/V into a scratch block that the block manager never hands out and attend
to that block alone, so they never touch a real sequence's cache. With `use_graphs=False` (the CPU,
tests) the same buffers run the forward eagerly: what a replay computes, without the graph.
"""

from __future__ import annotations

import torch

from llmctl.kernels.attention import PagedAttentionMetadata

# Batch sizes that get a graph (up to the engine's max_num_seqs): a batch runs in the smallest one
# that holds it, so padding wastes at most a third of a step above 8.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The captured sizes for an engine running at most `max_num_seqs` sequences (<= 256 each)."""
    sizes = tuple(s for s in GRAPH_BATCH_SIZES if s < max_num_seqs)
    return sizes + (min(max_num_seqs, GRAPH_BATCH_SIZES[-1]),)


def padded_size(sizes: tuple[int, ...], n: int) -> int | None:
    """The smallest size in `sizes` that holds `n` rows; None when none does."""
    return next((s for s in sizes if s >= n), None)


class DecodeGraphs:
    """Runs decode-only steps of up to max(sizes) sequences through static buffers.

    `model(input_ids [B], positions [B], meta, kv_caches) -> hidden [B, H]` is the engine's forward;
    `scratch_block` is a KV block id outside the block manager's range; `max_blocks` is the widest
    block table a sequence can have."""

    def __init__(
        self,
        model,
        kv_caches,
        sizes: tuple[int, ...],
        max_blocks: int,
        scratch_block: int,
        block_size: int,
        device: str | torch.device,
        use_graphs: bool,
        batch_invariant: bool = False,
    ):
        self.model, self.kv_caches, self.sizes = model, kv_caches, sizes
        # The fixed-order kernels are row-invariant, so a step padded to a captured size gives
        # each real row the bits it gets alone (kernels/cuda/invariant.py).
        self.batch_invariant = batch_invariant
        self.block_size, self.use_graphs = block_size, use_graphs
        self.max_blocks = max_blocks
        self.scratch_slot = scratch_block * block_size
        n = sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full(
            (n, max_blocks), scratch_block, dtype=torch.long, device=device
        )
        self.context_lens = torch.ones(n, dtype=torch.long, device=device)
        self._scratch_block = scratch_block
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.replays = 0  # steps served by a graph (or, eagerly, by the static buffers)

    def fits(self, num_rows: int, table_width: int) -> bool:
        return num_rows <= self.sizes[-1] and table_width <= self.max_blocks

    def run(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        context_lens: list[int],
    ) -> torch.Tensor:
        """One decode step of len(ids) sequences (row i: token ids[i] at positions[i], its K/V into
        slots[i], attending over tables[i] up to context_lens[i]). Returns hidden [len(ids), H], a
        view of a static buffer that the next call overwrites."""
        n = len(ids)
        b = padded_size(self.sizes, n)
        self._fill(b, ids, positions, slots, tables, context_lens)
        self.replays += 1
        if not self.use_graphs:
            return self._forward(b, max(context_lens))[:n]
        if b not in self.graphs:
            self.graphs[b] = self._capture(b)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]

    def _fill(self, b: int, ids, positions, slots, tables, context_lens) -> None:
        n, dev = len(ids), self.input_ids.device
        width = max(len(t) for t in tables)
        rows = torch.tensor(
            [t + [self._scratch_block] * (width - len(t)) for t in tables], dtype=torch.long
        )
        # One host-to-device copy per buffer; rows n..b-1 are padding: the scratch block, length 1.
        self.input_ids[:n].copy_(torch.tensor(ids, dtype=torch.long), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions, dtype=torch.long), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.tensor(slots, dtype=torch.long), non_blocking=True)
        self.block_tables[:n, :width].copy_(rows.to(dev, non_blocking=True))
        self.context_lens[:n].copy_(torch.tensor(context_lens, dtype=torch.long), non_blocking=True)
        # Columns past a row's length are never read (its context length stops it), but on the
        # eager path the reference gathers every column, so they must hold valid block ids: they do,
        # as the buffer starts as the scratch block and only ever receives block ids.
        self.input_ids[n:b].zero_()
        self.positions[n:b].zero_()
        self.slot_mapping[n:b].fill_(self.scratch_slot)
        self.block_tables[n:b].fill_(self._scratch_block)
        self.context_lens[n:b].fill_(1)

    def _meta(self, b: int, max_len: int) -> PagedAttentionMetadata:
        # No gather workspace: a buffer allocated inside a capture belongs to the graph's memory
        # pool.
        return PagedAttentionMetadata(
            self.slot_mapping[:b],
            b,
            self.block_tables[:b],
            self.context_lens[:b],
            [],
            self.block_size,
            None,
            None,
            max_len,
            self.batch_invariant,
        )

    def _forward(self, b: int, max_len: int) -> torch.Tensor:
        meta = self._meta(b, max_len)
        return self.model(self.input_ids[:b], self.positions[:b], meta, self.kv_caches)

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture. The
        warm-up runs on the step's real inputs: it writes the same K/V the replay writes again."""
        max_len = self.max_blocks * self.block_size
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(b, max_len)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(b, max_len)
        self._pool = graph.pool()
        return graph, out


def graphs_supported(model, config, device: str) -> bool:
    """Whether `model` (its ModelConfig `config`) may serve decode steps from graphs: CUDA graphs
    need a CUDA device and the Triton decode kernels (the PyTorch reference pads
    every block table to its full width, which a graph would fix at the longest possible context),
    and plain weight tensors: 2:4 sparse weights (a tensor subclass over cuSPARSELt) stay eager."""
    if not str(device).startswith("cuda") or not config.native or config.attention_features:
        return False
    if any(type(p.data) is not torch.Tensor for p in model.parameters()):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
