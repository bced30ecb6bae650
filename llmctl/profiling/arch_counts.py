"""Parameter, matrix, expert and attention counts of a non-native config, from transformers' model
of it built on the meta device (no memory, no weights, never code from a model folder).

Owns: `arch_counts(config)`, the facts `profiling/estimate.py` turns into bytes and FLOPs for any
family transformers builds (the Llama-layout formulas serve native configs):
- parameters: `sum(numel)` of the meta model's parameters, a tied embedding once;
- matrices (what quantized formats pack): every nn.Linear / Conv1D but the lm_head, and each fused
  3-D expert parameter ([E, out, in], or [E, in, out] where the experts module says
  `is_transposed`) as E matrices; a linear directly beside an `experts` child (a router, a shared
  expert's gate) is not one, nor are routers, norms, biases, sinks and position embeddings;
- MoE: routed experts' parameters, experts per layer E and experts per token k (active
  parameters = everything else + k / E of the experts); `experts_packed`: quantize packs them (it
  unfuses every fused experts module of the model: models/unfused_experts.py), else they stay dense;
- attention: per attention layer (kv_heads, key size, value size, query heads, sliding window),
  from the same probe forward that sizes the engine's cache at load
  (models/transformers_backend.py), so the KV bytes here are what the engine allocates; MLA's
  latent width (kv_lora_rank + qk_rope_head_dim) where the config has one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from llmctl.errors import ModelLoadError
from llmctl.models.config import ModelConfig

_TOP_K_NAMES = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "top_k")


@dataclass(frozen=True)
class AttentionLayer:
    kv_heads: int
    key_size: int
    value_size: int
    query_heads: int
    window: int | None  # sliding window in tokens; None: full attention


@dataclass(frozen=True)
class ArchCounts:
    num_parameters: int  # every parameter, a tied embedding once
    # (out_features, in_features, how many, routed expert) of the decoder's matrices
    matrices: tuple[tuple[int, int, int, bool], ...]
    vocab_size: int
    hidden_size: int
    embeddings: int  # 1: lm_head tied to the input embedding (or absent), 2: untied
    expert_parameters: int  # routed experts' parameters (matrices and biases), all layers
    expert_parameters_active: int  # the k experts a token is routed to, per layer, summed
    num_experts: int  # routed experts per MoE layer (0: dense)
    experts_per_token: int  # k (0: dense)
    attention: tuple[AttentionLayer, ...]
    cache_kv_heads: int  # the engine's cache: kv_heads x cache_head_dim per attention layer
    cache_head_dim: int  # max of key and value sizes (narrower values are zero-padded)
    mla_latent: int | None  # kv_lora_rank + qk_rope_head_dim per layer per token (MLA)
    experts_packed: bool = False  # quantize quantizes the routed experts (see the docstring)

    @property
    def active_parameters(self) -> int:
        return self.num_parameters - self.expert_parameters + self.expert_parameters_active

    def matrix_params(self, active: bool = False) -> int:
        """Elements of the decoder matrices; `active`: routed experts' at k / E."""
        total = 0
        for out_f, in_f, count, expert in self.matrices:
            n = count * out_f * in_f
            total += n * self.experts_per_token // self.num_experts if active and expert else n
        return total

    def flops_per_token(self, context: int) -> int:
        """2 x (active decoder matrices + lm_head) + per attention layer 2 x c x query heads x
        (key size + value size), c = min(context, the layer's window)."""
        matmul = self.matrix_params(active=True) + self.vocab_size * self.hidden_size
        attn = sum(
            2 * min(context, a.window or context) * a.query_heads * (a.key_size + a.value_size)
            for a in self.attention
        )
        return 2 * matmul + attn

    def windowed_tokens(self, seq_len: int, block_size: int) -> int | None:
        """Cache tokens a sequence of seq_len would hold if sliding-window layers kept only their
        window (min(seq_len, window) per such layer, rounded up to whole blocks), summed over the
        attention layers; None when no layer has a window."""
        if not any(a.window for a in self.attention):
            return None
        tokens = (min(seq_len, a.window or seq_len) for a in self.attention)
        return sum(-(-t // block_size) * block_size for t in tokens)

    def experts_touched(self, batch: int) -> float | None:
        """Expected distinct routed experts a decode step of `batch` tokens reads per MoE layer,
        routing uniform and independent: E x (1 - (1 - k/E)^batch). None: dense."""
        if not self.num_experts:
            return None
        e, k = self.num_experts, self.experts_per_token
        return e * (1 - (1 - k / e) ** batch)

    def estimate_fields(
        self, per_token: int, kv_element_bytes: int, seq_len: int, batch: int, block_size: int
    ) -> dict[str, Any]:
        """profiling/estimate.py's Estimate fields beyond the Llama layout; per_token: the
        engine's KV bytes per token (every attention layer's share is equal)."""
        windowed = self.windowed_tokens(seq_len, block_size)
        latent = self.mla_latent and len(self.attention) * self.mla_latent * kv_element_bytes
        return {
            "active_parameters": self.active_parameters,
            "num_experts": self.num_experts,
            "experts_per_token": self.experts_per_token,
            "decode_experts_touched": self.experts_touched(batch),
            "kv_bytes_per_token_mla_latent": latent or None,
            "kv_bytes_per_sequence_windowed": None
            if windowed is None
            else windowed * per_token // len(self.attention),
        }


def llama_layout(config: ModelConfig) -> bool:
    """The Llama-layout formulas count it (llama, mistral, qwen2, qwen3 on our own code); else
    `arch_counts` does: every other family, the native MoE and Gemma ones included."""
    return config.llama_layout


def arch_counts(config: ModelConfig) -> ArchCounts:
    """The counts of `config` (a non-native one: native configs have the Llama formulas)."""
    return _counts(json.dumps(config.raw, sort_keys=True))


@lru_cache(maxsize=8)
def _counts(raw_json: str) -> ArchCounts:
    from llmctl.models.transformers_backend import probe_attention

    hf = _meta_model(json.loads(raw_json))
    record: list = []
    _, kv_heads, head_dim = probe_attention(hf, record)
    text = hf.config.get_text_config()
    inp, out = hf.get_input_embeddings(), hf.get_output_embeddings()
    tied = out is None or out.weight is inp.weight
    matrices, experts = _matrices(hf, out)
    latent = None
    if getattr(text, "kv_lora_rank", None) and getattr(text, "qk_rope_head_dim", None):
        latent = int(text.kv_lora_rank) + int(text.qk_rope_head_dim)
    num_experts = max((e for e, _, _ in experts), default=0)
    top_k = 0
    if num_experts:
        top_k = next((int(v) for n in _TOP_K_NAMES if (v := getattr(text, n, None))), 0)
        if not top_k:
            raise ModelLoadError(f"{text.model_type}: has experts but no experts-per-token field")
    return ArchCounts(
        num_parameters=sum(p.numel() for p in hf.parameters()),
        matrices=tuple(matrices),
        vocab_size=int(inp.weight.shape[0]),
        hidden_size=int(inp.weight.shape[1]),
        embeddings=1 if tied else 2,
        expert_parameters=sum(n for _, n, _ in experts),
        expert_parameters_active=sum(n // e * min(top_k, e) for e, n, _ in experts),
        num_experts=num_experts,
        experts_per_token=top_k,
        attention=tuple(AttentionLayer(*r) for r in record),
        cache_kv_heads=kv_heads,
        cache_head_dim=head_dim,
        mla_latent=latent,
        experts_packed=_unfusable(hf),
    )


def _meta_model(raw: dict):
    """transformers' *ForCausalLM of `raw` on the meta device, ready for the probe forward."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    try:
        cfg = CONFIG_MAPPING[raw["model_type"]].from_dict(dict(raw))
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(cfg)
    except Exception as e:  # a config transformers cannot build: one line
        msg = f"{type(e).__name__}: {e}".splitlines()[0]
        raise ModelLoadError(f"cannot build {raw.get('model_type')!r} on the meta device: {msg}")
    try:  # fused experts' default kernel (grouped_mm) has no meta version; batched_mm has
        hf.set_experts_implementation("batched_mm")
    except Exception:  # no experts in this model
        pass
    # the padding warning reads a token id (.item()), which a meta tensor has not
    hf.config.pad_token_id = hf.config.get_text_config().pad_token_id = None
    return hf


def _unfusable(hf) -> bool:
    """Every fused experts module of `hf` is one quantize unfuses (and there is one)."""
    from llmctl.models.unfused_experts import UNFUSABLE

    fused = [m for m in hf.modules() if any(p.dim() == 3 for p in m.parameters(recurse=False))]
    return bool(fused) and all(type(m).__name__ in UNFUSABLE for m in fused)


def _matrices(hf, lm_head) -> tuple[list, list]:
    """([(out, in, count, expert)], [(E, routed expert params, module name)]) of `hf`."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    matrices, experts, expert_names, beside_experts = [], [], [], set()
    for name, module in hf.named_modules():
        fused = [p for p in module.parameters(recurse=False) if p.dim() == 3]
        if fused or (name.endswith("experts") and isinstance(module, nn.ModuleList)):
            e = fused[0].shape[0] if fused else len(module)
            experts.append((e, sum(p.numel() for p in module.parameters()), name))
            expert_names.append(name + ".")
            for p in fused:  # [E, out, in], or [E, in, out] when transposed
                o, i = (
                    p.shape[1:] if not getattr(module, "is_transposed", False) else p.shape[2:0:-1]
                )
                matrices.append((int(o), int(i), int(e), True))
        if "experts" in dict(module.named_children()):
            beside_experts |= {f"{name}.{c}" for c, _ in module.named_children()}
    for name, module in hf.named_modules():
        if (
            module is lm_head
            or name in beside_experts
            or not isinstance(module, (nn.Linear, Conv1D))
        ):
            continue
        w = module.weight  # nn.Linear [out, in]; Conv1D [in, out]
        o, i = (w.shape[1], w.shape[0]) if isinstance(module, Conv1D) else w.shape
        matrices.append((int(o), int(i), 1, name.startswith(tuple(expert_names))))
    return matrices, experts
