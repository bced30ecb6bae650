"""Per-family layer runners of the calibration driver (llmctl.compress.driver): where a model's
decoder layers are, what the first one reads, how one layer runs by itself, and which linears it
holds in which sub-layer groups.

Owns: `LayerRunner` (what the driver needs), `NativeRunner` (our LlamaForCausalLM: embeddings,
`layer.forward_dense(hidden, positions)`, the fixed groups of models/layout.py), and
`TransformersRunner` (any decoder transformers builds, wrapped by
models/transformers_backend.py), in llm-compressor's "sequential pipeline" manner:

  * inputs: a forward pre-hook on the first decoder layer records its hidden states and stops the
    forward, batch by batch; the keyword arguments the model passes each layer (position
    embeddings, position ids, masks: they depend on the batch's shape, not on the weights) are
    recorded once per batch size, from one full forward with a hook on every layer (families pass
    different ones to different layers: sliding-window and full attention);
  * groups: one traced forward of the layer on the first batch records the order in which its
    nn.Linear modules are called and the tensor each one reads; linears reading the same tensor
    form one group (q/k/v, gate/up), groups in call order, an MoE block's experts merged by role
    (all gate/up, then all down: `_experts_together`); linears the trace never called (an
    expert no token was routed to) come last, each its own group. Routers and gates
    (models.linears.never_compressed) are left out.

`runner_for(model)` picks the runner; `same_tensor` tells one tensor seen twice (the driver's
shared-input test too).
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import torch
from torch import nn

from llmctl.models.layout import SUBLAYER_GROUPS, SubLayerGroup
from llmctl.models.linears import decoder_layer_list, never_compressed, num_experts


class LayerRunner(Protocol):
    root: nn.Module  # the module whose names the records use (the checkpoint's names)
    prefix: str  # root's name of the decoder layer list ("model.layers", "transformer.h")
    layers: nn.ModuleList
    hidden_size: int

    def start(self, input_ids: torch.Tensor, batch_size: int) -> torch.Tensor:
        """input_ids [N, S] -> the first layer's hidden states [N, S, H] on the CPU."""

    def run(self, i: int, layer: nn.Module, hidden: torch.Tensor, device) -> torch.Tensor:
        """Layer i alone on hidden [B, S, H] (moved to `device`) -> its output hidden states."""

    def groups(self, i: int, layer: nn.Module, hidden: torch.Tensor, device) -> list[SubLayerGroup]:
        """Layer i's sub-layer groups (names relative to the layer), in forward order."""


class NativeRunner:
    """Our own LlamaForCausalLM: the fixed Llama groups, positions 0..S-1 for every row."""

    prefix = "model.layers"

    def __init__(self, model: nn.Module):
        self.root, self.layers = model, model.model.layers
        self.hidden_size = model.model.embed_tokens.embedding_dim
        self.positions: torch.Tensor | None = None

    def start(self, input_ids: torch.Tensor, batch_size: int) -> torch.Tensor:
        embed = self.root.model.embed_tokens
        self.positions = torch.arange(input_ids.shape[1])
        return embed(input_ids.to(embed.weight.device)).to("cpu")

    def run(self, i: int, layer: nn.Module, hidden: torch.Tensor, device) -> torch.Tensor:
        return layer.forward_dense(hidden.to(device), self.positions.to(device))[0]

    def groups(self, i: int, layer: nn.Module, hidden: torch.Tensor, device) -> list[SubLayerGroup]:
        return list(SUBLAYER_GROUPS)


class _Stop(Exception):
    """Raised by the capture hook once the first layer's inputs are recorded."""


def _to(value: Any, device) -> Any:
    """Tensors (also inside tuples and lists) moved to `device`; anything else as is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


class TransformersRunner:
    """A transformers decoder inside TransformersCausalLM (see the module docstring)."""

    def __init__(self, wrapper: nn.Module):
        self.root = wrapper.hf
        self.prefix, self.layers = decoder_layer_list(self.root)
        self.hidden_size = self.root.get_input_embeddings().embedding_dim
        self.experts = num_experts(self.root.config)
        self.kwargs: dict[int, list[dict[str, Any]]] = {}  # batch size -> each layer's kwargs
        self._moved: dict[tuple[int, int], dict[str, Any]] = {}  # (layer, batch) -> on device

    def start(self, input_ids: torch.Tensor, batch_size: int) -> torch.Tensor:
        starts = range(0, len(input_ids), batch_size)
        return torch.cat([self._capture(input_ids[b : b + batch_size]) for b in starts])

    @torch.no_grad()
    def _capture(self, ids: torch.Tensor) -> torch.Tensor:
        """The first layer's hidden states for ids [B, S]; every layer's kwargs for a new B."""
        every = ids.shape[0] not in self.kwargs
        seen: list[dict[str, Any]] = []
        first: list[torch.Tensor] = []

        def hook(module, args, kwargs):
            kw = dict(kwargs)
            hidden = args[0] if args else kw.pop("hidden_states")
            if not first:
                first.append(hidden.detach().to("cpu"))
            seen.append({k: _to(v, "cpu") for k, v in kw.items()})
            if not every:
                raise _Stop

        watched = self.layers if every else self.layers[:1]
        hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in watched]
        device = next(self.root.parameters()).device
        try:
            self.root.base_model(input_ids=ids.to(device), use_cache=False)
        except _Stop:
            pass
        finally:
            for h in hooks:
                h.remove()
        if every:
            self.kwargs[ids.shape[0]] = seen
        return first[0]

    def run(self, i: int, layer: nn.Module, hidden: torch.Tensor, device) -> torch.Tensor:
        key = (i, hidden.shape[0])
        if key not in self._moved:
            self._moved = {k: v for k, v in self._moved.items() if k[0] == i}
            self._moved[key] = {k: _to(v, device) for k, v in self.kwargs[key[1]][i].items()}
        out = layer(hidden.to(device), **self._moved[key])
        return out[0] if isinstance(out, tuple) else out

    @torch.no_grad()
    def groups(self, i: int, layer: nn.Module, hidden: torch.Tensor, device) -> list[SubLayerGroup]:
        linears = [
            (rel, m)
            for rel, m in layer.named_modules()
            if isinstance(m, nn.Linear)
            and not never_compressed(f"{self.prefix}.{i}.{rel}", m, self.experts)
        ]
        calls: list[tuple[str, torch.Tensor]] = []  # (relative name, input) in call order

        def record(rel):
            def hook(module, args):
                calls.append((rel, args[0]))

            return hook

        hooks = [m.register_forward_pre_hook(record(rel)) for rel, m in linears]
        try:
            self.run(i, layer, hidden, device)
        finally:
            for h in hooks:
                h.remove()
        return _group_calls(calls, [rel for rel, _ in linears])


def _group_calls(calls: list[tuple[str, torch.Tensor]], every: list[str]) -> list[SubLayerGroup]:
    """Linears reading the same tensor grouped, in first-call order; uncalled ones last, alone."""
    groups: list[tuple[list[str], torch.Tensor]] = []
    seen: set[str] = set()
    for rel, x in calls:
        if rel in seen:
            continue
        seen.add(rel)
        home = next((g for g in groups if g[1] is x or same_tensor(g[1], x)), None)
        if home is None:
            groups.append(([rel], x))
        else:
            home[0].append(rel)
    names = _experts_together([g[0] for g in groups]) + [[rel] for rel in every if rel not in seen]
    return [SubLayerGroup(f"group{k}", tuple(n), prev="") for k, n in enumerate(names)]


_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.([^.]+)$")


def _experts_together(groups: list[list[str]]) -> list[list[str]]:
    """The groups of an MoE block's experts merged by role: every expert's gate/up in one group
    (where the first one was), every expert's down in one. An expert's down reads only its own
    gate/up's output, so observing all downs after all gate/ups are processed is what one expert
    at a time would see, in 2 forward passes instead of 2 per expert."""
    merged: list[list[str]] = []
    home: dict[tuple, list[str]] = {}
    for names in groups:
        matches = [_EXPERT.match(n) for n in names]
        if not all(matches):
            merged.append(list(names))
            continue
        key = (matches[0].group(1), tuple(m.group(2) for m in matches))  # type: ignore[union-attr]
        if key in home:
            home[key].extend(names)
        else:
            home[key] = list(names)
            merged.append(home[key])
    return merged


def runner_for(model: nn.Module) -> LayerRunner:
    """NativeRunner for our own model, TransformersRunner for the transformers wrapper."""
    return TransformersRunner(model) if hasattr(model, "hf") else NativeRunner(model)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are views of the same memory with the same layout, unmodified in between."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
        and a._version == b._version
    )
