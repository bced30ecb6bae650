"""Any decoder-only model transformers builds, served on llmctl's paged KV cache: transformers'
own modeling code, with its attention calls sent to ours (vLLM's Transformers backend does the
same).

Owns: `TransformersCausalLM`, the engine's model interface (`forward(input_ids [T], positions
[T], meta, kv_caches) -> hidden [T, H]`, `compute_logits`, `forward_dense`) over a transformers
`*ForCausalLM`, and the attention function registered with transformers as "llmctl". The packed
step runs as one sequence of T tokens with explicit `position_ids`; transformers builds no mask
for an attention implementation it does not know (masking_utils returns None), and each
attention call reads the step's metadata to attend within each sequence over the paged cache:
kernels/attention.py where the layer's attention is plain, kernels/attention_features.py where it
has a sliding window, soft-capping, sinks or a value size unlike its key size. Outside an engine
step (calibration, eval, the load-time probe) the same formula runs on dense K/V, causally.

The cache shape (KV heads, head size) is found by a probe at load: one forward of two tokens,
recording each attention call's K and V shapes, since families name these differently (MLA's
keys are wider than its values). What this path cannot do (batch-invariant runs, being a draft
model, CUDA graphs) is refused by the engine in one line: see `LIMITS`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from llmctl.errors import ModelLoadError
from llmctl.kernels.attention import paged_attention
from llmctl.kernels.attention_features import Features, attend, paged_attention_with
from llmctl.kernels.config import KernelConfig
from llmctl.models.config import ModelConfig

IMPLEMENTATION = "llmctl"
LIMITS = "batch-invariant runs, draft-model speculation and CUDA graphs"


class _Step:
    """The engine step an attention call serves (None outside one) and the probe's record."""

    def __init__(self):
        self.meta = None
        self.kv_caches = None
        self.kernels = KernelConfig()
        # probing: (kv_heads, dk, dv, query heads, sliding window or None) per attention call
        self.shapes: list[tuple[int, int, int, int, int | None]] | None = None


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """transformers' attention interface: query [B, H, S, D], key [B, KVH, S, Dk], value
    [B, KVH, S, Dv] -> ([B, S, H, Dv], None)."""
    step: _Step = module.llmctl_step
    f = Features(
        scaling if scaling is not None else query.shape[-1] ** -0.5,
        kw.get("sliding_window"),
        kw.get("softcap"),
        kw.get("s_aux"),
    )
    if step.meta is None:
        if step.shapes is not None:
            shape = (key.shape[1], key.shape[-1], value.shape[-1], query.shape[1])
            step.shapes.append((*shape, f.sliding_window or None))
        return _dense(query, key, value, f), None
    k_cache, v_cache = step.kv_caches[module.llmctl_index]
    width = k_cache.shape[-1]
    # [T, heads, D], rows contiguous as the kernels read them
    q, k, v = (_pad(x[0].transpose(0, 1), width).contiguous() for x in (query, key, value))
    if f.plain:  # MLA's values are zero-padded to the key size: their extra columns come out 0
        out = paged_attention(q, k, v, k_cache, v_cache, step.meta, f.scale, step.kernels)
    else:
        out = paged_attention_with(q, k, v, k_cache, v_cache, step.meta, f, step.kernels)
    return out[None, ..., : value.shape[-1]], None


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """[..., D] zero-padded to [..., width] (the cache's head size; zeros change no score)."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _dense(query, key, value, f: Features) -> torch.Tensor:
    """Causal attention of one batch of equal-length sequences: [B, S, H, Dv]."""
    b, s = query.shape[0], query.shape[2]
    pos = torch.arange(s, device=query.device).expand(b, -1)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    return attend(q, k, v, pos, pos, f)


def register() -> None:
    """Make "llmctl" an attention implementation transformers accepts (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, _attention)


# Logit post-processing some families do in their *ForCausalLM.forward, after the lm_head.
def _final_logits(logits: torch.Tensor, config) -> torch.Tensor:
    if cap := getattr(config, "final_logit_softcapping", None):
        logits = torch.tanh(logits / cap) * cap
    if scale := getattr(config, "logit_scale", None):  # cohere
        logits = logits * scale
    if div := getattr(config, "logits_scaling", None):  # granite
        logits = logits / div
    return logits


class TransformersCausalLM(nn.Module):
    """See the module docstring. Build with `TransformersCausalLM.wrap(hf_model, config)`."""

    kernels: KernelConfig = KernelConfig()  # handed over by models/prepare.py

    def __init__(self, hf: nn.Module, config: ModelConfig, step: _Step):
        super().__init__()
        self.hf, self.config, self._step = hf, config, step

    @classmethod
    def wrap(cls, hf: nn.Module, config: ModelConfig) -> TransformersCausalLM:
        """Hook `hf`'s attention layers to a step slot, probe the cache shape, and wrap."""
        step = _Step()
        hf.set_attn_implementation(IMPLEMENTATION)
        layers, kv_heads, head_dim = _probe(hf, step)
        shape = dict(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)
        return cls(hf, dataclasses.replace(config, **shape), step)

    @property
    def lm_head(self) -> nn.Module:
        """The vocabulary projection (models/prepare.py tunes it for the logit rows)."""
        return self.hf.get_output_embeddings()

    def forward(self, input_ids, positions, meta, kv_caches) -> torch.Tensor:
        """Packed tokens [T] -> final hidden states [T, hidden]; K/V written to the caches."""
        step = self._step
        step.meta, step.kv_caches, step.kernels = meta, kv_caches, self.kernels
        try:
            out = self.hf.base_model(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False
            )
        finally:
            step.meta = step.kv_caches = None
        return out.last_hidden_state[0]

    def compute_logits(self, hidden, fixed_order: bool = False, float32: bool = True):
        """hidden [N, hidden] -> logits [N, vocab], post-processed as the family's head does."""
        logits = _final_logits(self.lm_head(hidden), self.hf.config)
        return logits.float() if float32 else logits

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] token ids -> [B, S, vocab] float32 logits, causal, no cache."""
        return self.hf(input_ids=input_ids, use_cache=False).logits.float()

    # The checkpoint's names, as transformers saves them (no "hf." before each): distill saves
    # and resumes students through these.
    def state_dict(self, *args, **kwargs):
        return self.hf.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.hf.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate=True):
        return self.hf.named_parameters(prefix, recurse, remove_duplicate)


def probe_attention(hf: nn.Module, record: list | None = None) -> tuple[int, int, int]:
    """(attention layers, KV heads, cache head size): the cache shape the engine allocates for
    `hf` (a meta-device model works too: memory estimates use it); `record` gets each layer's
    (kv_heads, key size, value size, query heads, sliding window or None)."""
    register()
    hf.set_attn_implementation(IMPLEMENTATION)
    return _probe(hf, _Step(), record)


def _probe(hf: nn.Module, step: _Step, layers: list | None = None) -> tuple[int, int, int]:
    """Give each module that calls the attention interface the step slot and its cache index
    (found by a recorded forward of two tokens: families name them differently), and return
    (attention layers, KV heads, cache head size) from the K/V shapes they pass, which must agree
    on the heads."""
    from transformers import AttentionInterface

    count = 0

    seen: set[int] = set()

    def record(module, *args, **kwargs):
        nonlocal count
        if id(module) not in seen:  # indices anew: layers may have been dropped since
            seen.add(id(module))
            module.llmctl_index, module.llmctl_step = count, step
            count += 1
        return _attention(module, *args, **kwargs)

    AttentionInterface.register(IMPLEMENTATION, record)
    step.shapes = shapes = []
    try:
        with torch.inference_mode():
            device = next(hf.parameters()).device
            hf.base_model(input_ids=torch.tensor([[1, 2]], device=device), use_cache=False)
    finally:
        register()
        step.shapes = None
    if layers is not None:
        layers.extend(shapes)
    if not shapes:
        raise ModelLoadError(
            f"{type(hf).__name__} does not call transformers' attention interface, so its "
            "attention cannot run on llmctl's paged KV cache"
        )
    heads = {s[0] for s in shapes}
    if len(heads) != 1 or len(shapes) != count:
        raise ModelLoadError(f"{type(hf).__name__}: layers with different KV head counts {heads}")
    return count, heads.pop(), max(max(s[1], s[2]) for s in shapes)
