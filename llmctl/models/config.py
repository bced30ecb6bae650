"""The model architecture facts llmctl needs, read from a Hugging Face `config.json`.

Owns: parsing and validating config dicts: those of the families our own model code runs
(`native`: SUPPORTED_ARCHITECTURES), including both spellings of RoPE settings
(`rope_theta`/`rope_scaling` and `rope_parameters`); and any other decoder-only architecture
transformers knows, read through transformers' own config class (its attribute names differ by
family: `n_embd`, `n_layer`...), for the transformers path (models/transformers_backend.py).
Whether our code can run a config, and why not, is decided here and nowhere else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmctl.errors import ModelLoadError

MOE_ARCHITECTURES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3_text")
SUPPORTED_ARCHITECTURES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", *MOE_ARCHITECTURES, *GEMMA_ARCHITECTURES,
)  # fmt: skip
# one sliding window for every layer, where set; qwen's own rule for which layers slide
WINDOWED = ("mistral", "mixtral", "phi3", "qwen3_moe")
LAYER_WINDOWED = ("qwen2", "qwen3", "qwen2_moe")


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP as each family defines it (models/moe.py)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # the top-k routing weights renormalised to sum to one
    float32_weights: bool  # routing weights stay float32 (mixtral), else the model's dtype (qwen)
    shared_intermediate_size: int = 0  # a shared expert behind a sigmoid gate (qwen2_moe); 0: none
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # mixtral: w1 w3 w2
    block_name: str = "mlp"  # the block's name in the checkpoint (mixtral: block_sparse_moe)


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head before RoPE (qwen3)
    qk_norm_whole: bool = False  # ... over the whole q / k projection instead (olmoe)
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    moe: MoeConfig | None = None  # mixture-of-experts MLPs (native MoE families)
    # Attention beyond plain causal attention (gemma2/3, mistral with a window):
    attn_scale: float | None = None  # None: head_dim ** -0.5 (gemma: query_pre_attn_scalar)
    attn_softcap: float | None = None  # scores capped at cap * tanh(score / cap) (gemma2)
    final_softcap: float | None = None  # the logits likewise (gemma2)
    layer_windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: global)
    local_rope_theta: float | None = None  # RoPE theta of the windowed layers (gemma3)
    # None: our own model code (models/llama.py) runs this config; else why it cannot (the
    # transformers path, models/transformers_backend.py, serves it)
    not_native: str | None = None

    @property
    def native(self) -> bool:
        return self.not_native is None

    @property
    def llama_layout(self) -> bool:
        """Our own code runs it with the Llama decoder layer (llama, mistral, qwen2, qwen3): what
        the config-only layouts (models/layout.py) and AWQ's folding assume."""
        return self.native and self.model_type in ("llama", "mistral", "qwen2", "qwen3")

    @property
    def fused_checkpoint(self) -> bool:
        """The checkpoint holds q/k/v and gate/up as one tensor each (phi3), which our layers
        load split: what our code writes would not be the family's layout."""
        return self.model_type == "phi3"

    @property
    def gemma(self) -> bool:
        """Gemma's conventions: norms scale by 1 + weight, embeddings by sqrt(hidden), GELU."""
        return self.model_type in GEMMA_ARCHITECTURES

    @property
    def attention_features(self) -> bool:
        """Some layer's attention has a window or soft-capping (kernels/attention_features.py):
        no batch-invariant runs, no lean steps (models/step.py), no CUDA graphs."""
        return bool(self.attn_softcap) or any(self.layer_windows)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """The config of any decoder-only model transformers knows; `native` where our code runs
        it. An architecture transformers does not know is a ModelLoadError."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            why = f"llmctl's own model code runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            return _from_transformers(d, f"{model_type!r} is not native ({why})")
        try:
            return cls._native(d)
        except _NotNative as e:
            return _from_transformers(d, str(e))

    @classmethod
    def _native(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d["model_type"]
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            rope_theta, rope_scaling = _rope_settings(d)
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            qk_norm = model_type in ("qwen3", "qwen3_moe", "gemma3_text", "olmoe")
            if d.get("clip_qkv") is not None:  # olmoe's option
                raise _NotNative(f"{model_type} with clip_qkv is not native")
            bias = d.get("qkv_bias", True) if model_type == "qwen2_moe" else d.get("attention_bias")
            rope_scaling, context = _extended(
                rope_scaling, int(d.get("max_position_embeddings", 2048))
            )
            window, every = _windows(d, context)
            return cls(
                model_type=model_type,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=context,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(model_type == "qwen2" if bias is None else bias),
                qk_norm=qk_norm,
                qk_norm_whole=model_type == "olmoe",
                rope_scaling=rope_scaling,
                sliding_window=window,
                moe=_moe(d) if model_type in MOE_ARCHITECTURES else None,
                **_attention_fields(d, every),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=d.get("torch_dtype") or d.get("dtype"),
                raw=dict(d),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: invalid JSON ({e})") from None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Exact parameter count of the checkpoint (embeddings counted once when tied)."""
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += self.q_size + self.kv_size if self.qk_norm_whole else 2 * self.head_dim
        mlps = [3 * h * f] * self.num_layers
        if self.moe is not None:
            m = self.moe
            sparse = m.num_experts * (3 * h * m.intermediate_size + h)  # experts and router rows
            if m.shared_intermediate_size:
                sparse += 3 * h * m.shared_intermediate_size + h
            mlps = [3 * h * f if i in m.dense_layers else sparse for i in range(self.num_layers)]
        head = 0 if self.tie_word_embeddings else v * h
        norms = 4 * h if self.model_type in ("gemma2", "gemma3_text") else 2 * h  # + post norms
        return v * h + self.num_layers * (attn + norms) + sum(mlps) + h + head


def _rope_settings(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (theta, scaling dict or None) from either config spelling."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    partial = (params or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _NotNative(f"partial RoPE (factor {partial}) is not native")
    scaling = d.get("rope_scaling")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = params
    else:
        theta = float(d.get("rope_theta", 10000.0))
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type in ("longrope", "su", "dynamic") or d.get("model_type") == "phi3":
            scaling = _standard_rope(d)  # phi3 reads "su" and "yarn" as longrope
            rope_type = scaling["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise _NotNative(
                f"RoPE scaling {rope_type!r} is not native (llmctl's own model code has "
                f"{', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if rope_type == "default":
            return theta, None
        return theta, {**scaling, "rope_type": rope_type}
    return theta, None


def _standard_rope(d: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters as transformers' config class for the model type standardises them
    (LongRoPE's `original_max_position_embeddings` filled in from wherever the family keeps it)."""
    from transformers import CONFIG_MAPPING

    params = CONFIG_MAPPING[d["model_type"]].from_dict(dict(d)).rope_parameters
    return dict(params.get("full_attention", params))


def _extended(scaling: dict[str, Any] | None, context: int) -> tuple[dict | None, int]:
    """(scaling, context): dynamic NTK serves `factor` times the trained context (vLLM's rule);
    the trained one stays in the scaling as its `original_max_position_embeddings`."""
    if not scaling or scaling["rope_type"] != "dynamic":
        return scaling, context
    scaling = {**scaling, "original_max_position_embeddings": context}
    return scaling, int(context * float(scaling["factor"]))


def _windows(d: dict[str, Any], context: int) -> tuple[int | None, tuple]:
    """(the sliding window, each layer's: None where it attends globally) as transformers'
    modeling code applies them: read through its config class, which nulls a window that
    `use_sliding_window` turns off and picks the sliding layers (`layer_types`; by default
    qwen2/qwen3 the layers from `max_window_layers` on, qwen2_moe the even ones below it). A
    window as long as the context is no window."""
    model_type, n = d["model_type"], int(d["num_hidden_layers"])
    if model_type not in WINDOWED + LAYER_WINDOWED or not d.get("sliding_window"):
        return None, (None,) * n
    from transformers import CONFIG_MAPPING

    t = CONFIG_MAPPING[model_type].from_dict(dict(d))
    window = getattr(t, "sliding_window", None) or None
    types = getattr(t, "layer_types", None) if model_type in LAYER_WINDOWED else None
    types = types or ["sliding_attention"] * n
    short = window if window and window < context else None
    return window, tuple(short if kind == "sliding_attention" else None for kind in types)


def _attention_fields(d: dict[str, Any], windows: tuple) -> dict[str, Any]:
    """The attention fields beyond plain attention: Gemma's, or mistral's one window."""
    if d["model_type"] in GEMMA_ARCHITECTURES:
        return _gemma(d)
    return dict(layer_windows=windows if any(windows) else ())


def _gemma(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma's attention fields, with each version's defaults (read through transformers'
    config): windows by `layer_types`, scale, soft-capping, gemma3's local RoPE theta."""
    from transformers import CONFIG_MAPPING

    t = CONFIG_MAPPING[d["model_type"]].from_dict(dict(d))
    types = getattr(t, "layer_types", None) or ["full_attention"] * t.num_hidden_layers
    window = getattr(t, "sliding_window", None)
    windows = tuple(window if kind == "sliding_attention" else None for kind in types)
    fields: dict[str, Any] = dict(
        attn_scale=float(getattr(t, "query_pre_attn_scalar", None) or t.head_dim) ** -0.5,
        attn_softcap=getattr(t, "attn_logit_softcapping", None) or None,
        final_softcap=getattr(t, "final_logit_softcapping", None) or None,
        layer_windows=windows if any(windows) else (),
    )
    params = getattr(t, "rope_parameters", None)
    if isinstance(params, dict) and "sliding_attention" in params:
        local = params["sliding_attention"]
        if local.get("rope_type", "default") != "default":
            raise _NotNative("gemma3 with scaled RoPE on its sliding layers is not native")
        fields["local_rope_theta"] = float(local["rope_theta"])
    return fields


def _moe(d: dict[str, Any]) -> MoeConfig:
    """The MoE settings, with each family's defaults (read through transformers' config)."""
    from transformers import CONFIG_MAPPING

    t = CONFIG_MAPPING[d["model_type"]].from_dict(dict(d))
    if d["model_type"] == "olmoe":  # every layer sparse, the experts `intermediate_size` wide
        return MoeConfig(
            t.num_experts, t.num_experts_per_tok, t.intermediate_size, bool(t.norm_topk_prob), False
        )
    if d["model_type"] == "mixtral":
        names = ("w1", "w3", "w2")
        return MoeConfig(
            t.num_local_experts, t.num_experts_per_tok, t.intermediate_size, True, True,
            expert_names=names, block_name="block_sparse_moe",
        )  # fmt: skip
    sparse_step, only_dense = t.decoder_sparse_step, set(t.mlp_only_layers or ())
    dense = tuple(
        i
        for i in range(t.num_hidden_layers)
        if i in only_dense or not (t.num_experts > 0 and (i + 1) % sparse_step == 0)
    )
    shared = int(getattr(t, "shared_expert_intermediate_size", 0) or 0)
    return MoeConfig(
        t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size, bool(t.norm_topk_prob),
        False, shared, dense,
    )  # fmt: skip


class _NotNative(Exception):
    """A config of a native family that our model code cannot run (the message says why)."""


def _from_transformers(d: dict[str, Any], why: str) -> ModelConfig:
    """The facts the engine and the estimates need, read through transformers' config class for
    the model type (its attribute map and defaults), from the text config of a multimodal one."""
    model_type = d.get("model_type")
    try:
        from transformers import CONFIG_MAPPING

        hf = CONFIG_MAPPING[model_type].from_dict(dict(d)) if model_type else None
    except KeyError:
        hf = None
    except Exception as e:  # the config class rejects a value
        raise ModelLoadError(f"config.json: {type(e).__name__}: {e}".splitlines()[0]) from None
    if hf is None:
        raise ModelLoadError(
            f"unknown architecture {model_type!r}: transformers has no model of that type, and "
            "llmctl never runs code from a model folder; supported: llama, mistral, qwen2, "
            "qwen3 natively, and any decoder model transformers builds"
        )
    t = hf.get_text_config()
    heads = int(t.num_attention_heads)
    hidden = int(t.hidden_size)
    eos = d.get("eos_token_id", getattr(t, "eos_token_id", None))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(t.vocab_size),
        hidden_size=hidden,
        intermediate_size=int(_first(t, "intermediate_size", "n_inner", "ffn_hidden_size") or 0),
        num_layers=int(t.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(t, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(t, "head_dim", None) or hidden // heads),
        rms_norm_eps=float(_first(t, "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon") or 0),
        rope_theta=float(getattr(t, "rope_theta", None) or 10000.0),
        max_position_embeddings=int(getattr(t, "max_position_embeddings", None) or 2048),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        sliding_window=getattr(t, "sliding_window", None),
        bos_token_id=d.get("bos_token_id", getattr(t, "bos_token_id", None)),
        eos_token_ids=eos_ids,
        torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "") or None,
        raw=dict(d),
        not_native=why,
    )


def _first(obj, *names: str):
    """The first of `names` that `obj` has and is not None."""
    return next((v for n in names if (v := getattr(obj, n, None)) is not None), None)
