"""Our model code for the Llama family: llama, mistral, qwen2 (q/k/v bias), qwen3 (q/k RMSNorm) and
phi3 (its checkpoint's fused projections split at load: `checkpoint_tensors`), Gemma's,
and their mixture-of-experts forms qwen2_moe, qwen3_moe, mixtral and olmoe (q/k norms over the
whole projection) (models/moe.py in place of the MLP).

Owns: the decoder layer and model, composed of models/layers.py's layers, and three forward paths
over the same weights:
- `forward(input_ids [T], positions [T], meta, kv_caches)`: the engine's packed, paged-KV path
  (with `meta.batch_invariant`, every projection and the MLP through `project` and
  kernels/invariant.py, whose rows do not depend on each other);
- `forward_dense(input_ids [B, S])`: plain causal attention with no cache (calibration, eval,
  training), and over the same layer code `forward_cached(input_ids [S], start, cache)`, after a
  dense per-request cache (the speculative draft).
Parameter names equal Hugging Face's, so checkpoints load (and save) one to one. Before an engine
serves it, models/prepare.py prepares the model for inference (merged projections, kernel
choices, and on the CPU in bf16 `lean`: whether `forward`'s steps may take models/step.py's lean
path, the same layer methods called directly on shared buffers).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from llmctl.kernels.attention import PagedAttentionMetadata
from llmctl.models import step as steps
from llmctl.models.config import ModelConfig
from llmctl.models.layers import MLP, Attention, Linear, RMSNorm, project
from llmctl.models.moe import SparseMoE
from llmctl.models.rope import RotaryEmbedding
from llmctl.models.step import call


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, index: int = 0):
        super().__init__()
        window = config.layer_windows[index] if config.layer_windows else None
        self.self_attn = Attention(config, rotary, window)
        # the MLP, or a mixture of experts under the checkpoint's name for it (models/moe.py)
        moe = config.moe
        self._ffn = "mlp"
        if moe is not None and index not in moe.dense_layers:
            self._ffn = moe.block_name
            setattr(self, self._ffn, SparseMoE(config))
        else:
            self.mlp = MLP(config)
        h, eps, gemma = config.hidden_size, config.rms_norm_eps, config.gemma
        self.input_layernorm = RMSNorm(h, eps, gemma)
        self.post_attention_layernorm = RMSNorm(h, eps, gemma)
        # gemma2/3: the attention and MLP outputs are normed too, before their residual adds
        self.post_norms = config.model_type in ("gemma2", "gemma3_text")
        if self.post_norms:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(h, eps, gemma)

    def forward(self, x, positions, meta, kv_cache, delta=None, step=None):
        """The engine's path (inference only): x [T, hidden] the residual stream, updated in
        place; `delta` [T, hidden] the previous layer's output not yet added to it (None: none).
        Returns (x, this layer's MLP output): the next layer (or the final norm) adds it, fused
        with its RMSNorm, as each residual add here is. A lean `step` (models/step.py; never
        with post-norms or experts): the same calls, directly, on its buffers."""
        fixed = meta.batch_invariant
        h = self.input_layernorm.add_forward(x, delta, fixed, step)
        a = call(self.self_attn, step, h, positions, meta, kv_cache)
        if self.post_norms:
            h = self.pre_feedforward_layernorm.add_forward(x, self.post_attention_layernorm(a))
            return x, self.post_feedforward_layernorm(self.ffn(h, fixed))
        h = self.post_attention_layernorm.add_forward(x, a, fixed, step)
        return x, call(self.ffn, step, h, fixed)

    def forward_dense(self, x: torch.Tensor, positions: torch.Tensor, past=None):
        """x [B, S, hidden] at positions [S] (after `past`, a dense cache, where given) ->
        (x [B, S, hidden], this layer's (k, v) with `past`)."""
        a, cache = self.self_attn.forward_dense(self.input_layernorm(x), positions, past)
        if self.post_norms:
            x = x + self.post_attention_layernorm(a)
            return x + self.post_feedforward_layernorm(
                self.ffn(self.pre_feedforward_layernorm(x))
            ), cache
        x = x + a
        return x + self.ffn(self.post_attention_layernorm(x)), cache

    @property
    def ffn(self) -> nn.Module:
        """The MLP or mixture-of-experts block, whatever the checkpoint names it."""
        return getattr(self, self._ffn)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, local: RotaryEmbedding):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        windows = config.layer_windows or (None,) * config.num_layers
        self.layers = nn.ModuleList(
            DecoderLayer(config, local if w else rotary, i) for i, w in enumerate(windows)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.gemma)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config)
        # gemma3's windowed layers turn by a RoPE of their own
        self.rotary_local = self.rotary
        if config.local_rope_theta:
            local = dataclasses.replace(
                config, rope_theta=config.local_rope_theta, rope_scaling=None
            )
            self.rotary_local = RotaryEmbedding(local)
        self.model = LlamaModel(config, self.rotary, self.rotary_local)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # models/step.Watch where the engine's steps may take the lean path (models/prepare.py)
        self.lean: Any = None

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; Gemma's scaled by sqrt(hidden) in the model's dtype."""
        x = self.model.embed_tokens(input_ids)
        if self.config.gemma:
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

    def forward(
        self, input_ids, positions, meta: PagedAttentionMetadata, kv_caches
    ) -> torch.Tensor:
        """Packed tokens [T] -> final hidden states [T, hidden] (normed); K/V written to the
        caches."""
        step = None
        if self.lean is not None:  # None: not lean (models/step.py)
            step = steps.begin(self, input_ids, positions, meta, kv_caches)
        x, delta = self.embed(input_ids), None
        for layer, kv in zip(self.model.layers, kv_caches):
            x, delta = call(layer, step, x, positions, meta, kv, delta)
        return self.model.norm.add_forward(x, delta, meta.batch_invariant, step)

    def compute_logits(
        self, hidden: torch.Tensor, fixed_order: bool = False, float32: bool = True
    ) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab]: float32, or with `float32=False` as the
        projection gives them (the model's dtype: the engine's greedy steps read bf16 logits
        as they are); `fixed_order`: batch-invariant."""
        logits = project(self.lm_head, hidden, fixed_order, self.lm_head.kernels)
        if cap := self.config.final_softcap:  # gemma2
            logits = torch.tanh(logits.float() / cap) * cap
            return logits if float32 else logits.to(hidden.dtype)
        return logits.float() if float32 else logits

    def _dense(self, input_ids: torch.Tensor, start: int, cache: list | None):
        """[B, S] token ids at positions start.. after a dense per-layer cache (None: none) ->
        (final hidden states [B, S, hidden], normed; the per-layer cache extended)."""
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        x, new_cache = self.embed(input_ids), []
        for i, layer in enumerate(self.model.layers):
            x, c = layer.forward_dense(x, positions, None if cache is None else cache[i])
            new_cache.append(c)
        return self.model.norm(x), new_cache

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] token ids -> [B, S, vocab] float32 logits, causal, no cache."""
        return self.compute_logits(self._dense(input_ids, 0, None)[0])

    def forward_cached(self, input_ids: torch.Tensor, start: int, cache: list | None):
        """Tokens [S] at positions start.. after a dense per-layer cache (None: empty).
        Returns (float32 logits of the last token [V], the extended cache)."""
        hidden, new_cache = self._dense(input_ids[None], start, cache)
        return self.compute_logits(hidden[0, -1:])[0], new_cache

    @staticmethod
    def trim_cache(cache: list | None, length: int) -> list | None:
        """Keep the first `length` positions of a `forward_cached` cache ([1, kv_heads, P, D])."""
        if cache is None or length == 0:
            return None
        return [(k[:, :, :length], v[:, :, :length]) for k, v in cache]


def checkpoint_tensors(config: ModelConfig, tensors):
    """(file, name, tensor) triples of a checkpoint as our layers name them: phi3's fused
    `qkv_proj` [q + 2 kv, hidden] and `gate_up_proj` [2 intermediate, hidden] split into the
    projections they hold (in that order)."""
    for file, name, t in tensors:
        if not config.fused_checkpoint:
            yield file, name, t
        elif name.endswith("self_attn.qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            sizes = [config.q_size, config.kv_size, config.kv_size]
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split(sizes)):
                yield file, f"{base}{part}.weight", piece
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            gate, up = t.chunk(2)
            yield file, f"{base}gate_proj.weight", gate
            yield file, f"{base}up_proj.weight", up
        else:
            yield file, name, t
