"""Mixture-of-experts MLPs of the native MoE families (qwen2_moe, qwen3_moe, mixtral,
olmoe).

Owns: `SparseMoE`, the block that replaces a decoder layer's MLP: a router (`gate`, a linear to
one logit per expert; never quantized), softmax over experts in float32, the top-k, renormalised
where the family does (`MoeConfig.norm_topk_prob`), and the experts, each a gated-SiLU `MLP` of
models/layers.py (so each merges, tunes and takes the CPU kernels as any MLP), optionally a shared
expert behind a sigmoid gate (qwen2_moe). Tokens are grouped by expert: one GEMM per expert that
any token chose, in expert order, its outputs scaled by their routing weights and added into
place, as transformers' own loop does (so greedy outputs agree with it).
Parameter names equal the checkpoints' (`mlp.experts.E.gate_proj`, mixtral's
`block_sparse_moe.experts.E.w1`), so weights load and save one to one.
"""

from __future__ import annotations

import torch
from torch import nn

from llmctl.models.config import ModelConfig
from llmctl.models.layers import MLP, Linear


class Expert(MLP):
    """A gated-SiLU MLP under the checkpoint's names (mixtral's w1 / w3 / w2 for gate / up /
    down): `MLP` reads them through the properties below."""

    def __init__(self, config: ModelConfig, intermediate: int, names: tuple[str, str, str]):
        nn.Module.__init__(self)
        h = config.hidden_size
        self._names = names
        gate, up, down = names
        setattr(self, gate, Linear(h, intermediate, bias=False))
        setattr(self, up, Linear(h, intermediate, bias=False))
        setattr(self, down, Linear(intermediate, h, bias=False))
        self.merged, self.gelu = None, False

    gate_proj = property(lambda self: self._modules[self._names[0]])
    up_proj = property(lambda self: self._modules[self._names[1]])
    down_proj = property(lambda self: self._modules[self._names[2]])


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        m = config.moe
        h = config.hidden_size
        self.top_k, self.norm_topk_prob, self.float32_weights = (
            m.top_k,
            m.norm_topk_prob,
            m.float32_weights,
        )
        self.gate = Linear(h, m.num_experts, bias=False)
        self.experts = nn.ModuleList(
            Expert(config, m.intermediate_size, m.expert_names) for _ in range(m.num_experts)
        )
        if m.shared_intermediate_size:
            self.shared_expert = MLP(config, m.shared_intermediate_size)
            self.shared_expert_gate = Linear(h, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k], expert ids [T, k])."""
        logits = self.gate(x)  # [T, E]
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(x.dtype)), ids

    def forward(self, x: torch.Tensor, fixed_order: bool = False) -> torch.Tensor:
        """x [..., H] -> [..., H]. `fixed_order` (batch-invariant runs): each expert's rows go
        through MLP's fixed-order path too."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        # every (token, choice) pair sorted by expert, tokens in order within each: one gather
        # of the rows, a contiguous slice of them per expert, one scatter-add of the results
        order = ids.flatten().argsort(stable=True)  # [T * k]: token t's j-th choice at t * k + j
        tokens = order // self.top_k
        scale = weights.flatten()[order, None]  # [T * k, 1]
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()
        rows = x[tokens]  # [T * k, H]
        ys = torch.empty_like(rows) if scale.dtype is x.dtype else None
        parts, start = [], 0
        for expert, count in zip(self.experts, counts):
            if count:
                y = expert(rows[start : start + count], fixed_order) * scale[start : start + count]
                if ys is not None:
                    ys[start : start + count] = y
                else:
                    parts.append(y.to(x.dtype))  # float32 routing weights (mixtral)
                start += count
        out = torch.zeros_like(x).index_add_(0, tokens, ys if ys is not None else torch.cat(parts))
        if self.shared_expert is not None:
            shared = self.shared_expert(x, fixed_order)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out.view(shape)
