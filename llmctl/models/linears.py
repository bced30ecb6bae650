"""Which weights of a model compression may change, on either model implementation (used by
compression and by the estimates).

Owns: `weights_root` (the module whose parameter names are the checkpoint's: our own model, or
the transformers model inside models/transformers_backend.py's wrapper), `decoder_layer_list`
(the decoder layers of a transformers model: the nn.ModuleList under `base_model` whose length is
`num_hidden_layers`), `never_compressed` (MoE routers and gates), `compressible_linears` (name,
out, in of every decoder linear compression may change, from a loaded model), `config_linears`
(the same before loading: from the config alone for the native families, from the transformers
model built on the meta device for the rest), `fused_experts` (experts still stored as 3-D
parameters after `prepare_for_compression` unfused those models/unfused_experts.py knows: they
stay dense), `linearize` and `export_state` (GPT-2's Conv1D is an nn.Linear while compressing and
written back in its own [in, out] layout), `checkpoint_names` (a transformers module's name as
its checkpoints spell it: mixtral's `mlp.` is `block_sparse_moe.` there).
"""

from __future__ import annotations

import torch
from torch import nn

from llmctl.models.unfused_experts import unfuse_experts

# last name component of a router/gate linear (it outputs one logit per expert, or one gate
# value): quantizing or pruning it would change which experts run
ROUTER_NAMES = ("gate", "router", "gating", "shared_expert_gate")


def weights_root(model: nn.Module) -> nn.Module:
    """The module whose parameter names are the checkpoint's names."""
    return getattr(model, "hf", model)


def decoder_layer_list(hf: nn.Module) -> tuple[str, nn.ModuleList]:
    """(name under `hf`, the list) of a transformers model's decoder layers."""
    n_layers = getattr(hf.config, "num_hidden_layers", None)
    base = hf.base_model
    base_name = next((n for n, m in hf.named_modules() if m is base), "")
    for name, module in base.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n_layers:
            full = ".".join(p for p in (base_name, name) if p)
            return full, module
    raise ValueError(f"{type(hf).__name__}: no list of {n_layers} decoder layers found")


def num_experts(config) -> int:
    """Routed experts per MoE layer from a transformers config (0 for a dense model)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def never_compressed(name: str, module: nn.Module, experts: int) -> bool:
    """A router or gate: named so, or a linear whose outputs are one logit per expert."""
    last = name.rsplit(".", 1)[-1]
    return last in ROUTER_NAMES or (experts > 0 and getattr(module, "out_features", 0) == experts)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _shape(module: nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of an nn.Linear or a transformers Conv1D ([in, out] weight)."""
    if _is_conv1d(module):
        return module.nf, module.weight.shape[0]
    return module.out_features, module.in_features


def decoder_modules(root: nn.Module):
    """(name, module) of every linear (or Conv1D) inside the decoder layers, and the routers."""
    if hasattr(root, "base_model_prefix"):  # a transformers PreTrainedModel
        prefix, _ = decoder_layer_list(root)
    else:
        prefix = "model.layers"
    experts = num_experts(getattr(root, "config", None))
    for name, module in root.named_modules():
        if name.startswith(prefix + ".") and (isinstance(module, nn.Linear) or _is_conv1d(module)):
            yield name, module, never_compressed(name, module, experts)


def compressible_linears(root: nn.Module) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of the decoder linears compression may change."""
    return [(n, *_shape(m)) for n, m, router in decoder_modules(root) if not router]


def router_names(root: nn.Module) -> list[str]:
    """The decoder's routers and gates (listed in the output's ignore list): the linears
    `never_compressed` names, and router modules of their own class (transformers 5's MoE
    routers hold a plain weight parameter)."""
    linears = {n for n, _, router in decoder_modules(root) if router}
    prefix = decoder_layer_list(root)[0] if hasattr(root, "base_model_prefix") else "model.layers"
    return [
        name
        for name, _ in root.named_modules()
        if name.startswith(prefix + ".")
        and (name in linears or name.rsplit(".", 1)[-1] in ROUTER_NAMES)
    ]


def fused_experts(root: nn.Module) -> tuple[list[str], int]:
    """(module names, parameter count) of experts stored as 3-D parameters (transformers 5's
    fused MoE layout: [experts, out, in] tensors, not nn.Linear): they stay dense."""
    names, count = [], 0
    for name, module in root.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.dim() == 3]
        if own:
            names.append(name)
            count += sum(p.numel() for p in own)
    return names, count


def meta_model(raw: dict):
    """The transformers model of a config.json's contents, on the meta device (no weights, no
    code from a model folder)."""
    import transformers

    raw = {k: v for k, v in raw.items() if k != "quantization_config"}
    config = transformers.CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False)


def checkpoint_names(root: nn.Module, names: list[str]) -> dict[str, str]:
    """Module name -> the checkpoint's name of that module, for modules of `root` (a transformers
    model's renamings reverted, as `export_state` reverts them for the weights)."""
    probe = {f"{n}.weight": torch.tensor(i) for i, n in enumerate(names)}
    try:  # each probe tensor holds its name's index; a renaming keeps it
        back = _checkpoint_names(root, probe)
    except Exception:  # a family converting linear weights (a split) at load: names as they are
        back = probe
    spelled = {int(t): k.removesuffix(".weight") for k, t in back.items() if t.dim() == 0}
    return {n: spelled.get(i, n) for i, n in enumerate(names)}


def config_linears(config) -> list[tuple[str, int, int]]:
    """compressible_linears before loading: the native families' from the config alone, the
    others' from their transformers model built on the meta device."""
    from llmctl.models.layout import decoder_linears

    if config.llama_layout:
        return decoder_linears(config)
    model = meta_model(config.raw)
    unfuse_experts(model)  # as prepare_for_compression does: each expert's linears count
    return compressible_linears(model)


def linearize(root: nn.Module) -> list[str]:
    """Replace each Conv1D inside the decoder layers by the nn.Linear computing the same function
    (weight transposed to [out, in]); returns their names (for `export_state`)."""
    done = []
    for name, module, _ in list(decoder_modules(root)):
        if not _is_conv1d(module):
            continue
        out_f, in_f = _shape(module)
        linear = nn.Linear(in_f, out_f, bias=module.bias is not None, dtype=module.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(module.weight.t())
            if module.bias is not None:
                linear.bias.copy_(module.bias)
        parent, child = name.rsplit(".", 1)
        setattr(root.get_submodule(parent), child, linear.requires_grad_(False))
        done.append(name)
    return done


def export_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters by checkpoint name in the checkpoint's layout (a linearized Conv1D's weight
    transposed back to [in, out], fused experts split again); tensors are the model's own
    (callers copy)."""
    root = weights_root(model)
    transposed = {f"{n}.weight" for n in getattr(model, "linearized", ())}
    params = root.named_parameters(remove_duplicate=False)  # a tied lm_head too, as state dicts
    state = {k: (v.t() if k in transposed else v).detach() for k, v in params}
    return _checkpoint_names(root, state)


def _checkpoint_names(root: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers model's tensors as its checkpoints name and shape them: transformers fuses
    some at load (MoE experts into [E, ...] tensors) and splits them again when it saves; the
    same reversal here, so the output loads wherever the original does (our native MoE code,
    vLLM). Models of ours are already in checkpoint form."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # an older transformers fuses nothing
        return state
    if not isinstance(root, PreTrainedModel):
        return state
    return dict(revert_weight_conversion(root, state))


def prepare_for_compression(model: nn.Module, warn) -> None:
    """After loading, before any step: a transformers model's Conv1D become nn.Linear (names kept
    on `model.linearized`), its fused experts of a known layout one nn.Linear per projection
    (models/unfused_experts.py: the driver calibrates each on its routed tokens), and a warning
    names the fused experts that stay dense."""
    if not hasattr(model, "hf"):
        return
    model.linearized = linearize(model.hf)
    unfuse_experts(model.hf)
    names, count = fused_experts(model.hf)
    if names:
        warn(
            f"{len(names)} MoE expert blocks store their experts as fused 3-D tensors, not "
            f"linear layers: their {count:,} parameters stay dense (listed in the ignore list)"
        )


def kept_dense(model: nn.Module) -> list[str]:
    """What the output's ignore list names beyond --ignore and lm_head: the routers and gates,
    and the modules still holding fused experts, by their checkpoint names."""
    root = weights_root(model)
    names = [*router_names(root), *fused_experts(root)[0]]
    return list(checkpoint_names(root, names).values())
