"""Layer-by-layer calibration driver, shared by `quantize` and `sparsify`.

Owns: `calibrate_layers`, which walks the decoder one layer at a time (only that layer on the
device), captures the inputs of its linears with forward hooks, hands them to a `LayerMethod`
sub-layer group by sub-layer group (q/k/v, then o, then gate/up, then down: each group observed
on the outputs of the groups already processed, or, for a method with `whole_layer`, all of them
in one pass over the unprocessed layer), then produces the next layer's inputs from the processed
layer. Where the layers are, how one runs alone and what its groups are is the model family's
`LayerRunner` (llmctl.compress.layer_runners: our own Llama layers, or any transformers decoder).
After each layer it checkpoints (layer weights, the method's records, the next layer's inputs;
llmctl.compress.checkpoints: safetensors and JSON) into `checkpoint_dir`, so an interrupted run
resumes after the last finished layer.

MoE experts calibrate each on the tokens routed to it: each expert's projections are nn.Linear
modules of their own (our MoE blocks; transformers 5's fused experts unfused first by
models/unfused_experts.py, through models/linears.py `prepare_for_compression`), so the hooks see
only an expert's own tokens and it gets its own Hessian. An expert that saw too few tokens is
`starved` (the rule, MIN_ROUTED_TOKENS, is documented there, the one place it lives) and is
handled as with no data. llm-compressor's alternative, routing every token through every expert
while calibrating, is not done. Fused experts of other layouts (gpt_oss, deepseek_v3) stay dense.

A method implements the `LayerMethod` protocol below; `HessianMethod` adapts a per-linear function
`fn(name, linear, H) -> record` (GPTQ, RTN, SparseGPT, Wanda) to it.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch import nn

from llmctl.compress import checkpoints
from llmctl.compress.hessian import HessianAccumulator
from llmctl.compress.layer_runners import LayerRunner, runner_for, same_tensor
from llmctl.errors import LlmctlError, UsageError
from llmctl.models.layout import SubLayerGroup


class LayerMethod(Protocol):
    def observe(self, name: str, x: torch.Tensor) -> None:
        """x [B, S, in]: inputs of linear `name` (full module name) for one calibration batch."""

    def process_group(
        self, layer_index: int, layer: nn.Module, group: SubLayerGroup, names: list[str]
    ) -> dict[str, Any]:
        """Change the group's linears in place; return a record per full linear name (may be
        empty)."""

    def finish_layer(self, layer_index: int, layer: nn.Module) -> dict[str, Any]:
        """Called once all groups of the layer are processed; return more records (may be empty)."""


def make_ignore(patterns: list[str]) -> Callable[[str], bool]:
    """Predicate on full module names: glob patterns, or `re:REGEX` (compressed-tensors style).
    A pattern that is not a string or a regex that does not compile is refused here, up front."""
    regexes = {}
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise UsageError(f"--ignore takes module names, globs or re:REGEX, got {p!r}")
        if p.startswith("re:"):
            try:
                regexes[p] = re.compile(p[3:])
            except re.error as e:
                raise UsageError(f"--ignore {p!r}: invalid regular expression ({e})") from None

    def ignored(name: str) -> bool:
        for p in patterns:
            if p in regexes:
                if regexes[p].search(name):
                    return True
            elif name == p or fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, f"*.{p}"):
                return True
        return False

    return ignored


def unmatched_patterns(patterns: list[str], names: list[str]) -> list[str]:
    """The --ignore patterns that match none of `names` (worth a warning: likely a typo)."""
    return [p for p in patterns if not any(make_ignore([p])(n) for n in names)]


@dataclass
class DriverResult:
    records: dict[str, Any] = field(default_factory=dict)  # full linear name -> method record
    resumed_layers: int = 0  # layers taken from the checkpoint instead of recomputed


def _run_layer(
    runner: LayerRunner,
    i: int,
    layer: nn.Module,
    hidden: torch.Tensor,
    device,
    batch_size: int,
    keep: bool,
):
    """Layer i alone over hidden [N, S, H] in mini-batches (its output, not its cache); returns
    the outputs (on CPU) if keep."""
    outs = []
    for b in range(0, hidden.shape[0], batch_size):
        try:
            y = runner.run(i, layer, hidden[b : b + batch_size], device)
        except _StopForward:
            continue
        if keep:
            outs.append(y.to("cpu"))
    return torch.cat(outs) if keep else None


def relative_name(name: str) -> str:
    """A linear's name relative to its decoder layer ("model.layers.3.mlp.up_proj" ->
    "mlp.up_proj"): what follows the first numeric component."""
    match = _LAYER_INDEX.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not inside a decoder layer")
    return name[match.end() :]


_LAYER_INDEX = re.compile(r"^.*?\.\d+\.")


@torch.no_grad()
def _calibrate_layer(
    i: int,
    layer: nn.Module,
    method: LayerMethod,
    ignore: Callable[[str], bool],
    run: Callable[..., Any],
    layer_groups: list[SubLayerGroup],
    prefix: str,
) -> dict[str, Any]:
    """Layer i's sub-layer groups in order, then the method's end-of-layer step; returns their
    records. A method with `whole_layer` set sees every linear's inputs from one pass over the
    unprocessed layer; otherwise each group is observed on the outputs of those before it."""
    records: dict[str, Any] = {}
    groups = []
    for group in layer_groups:
        names = [f"{prefix}.{i}.{rel}" for rel in group.linears]
        groups.append((group, [n for n in names if not ignore(n)]))
    groups = [(group, names) for group, names in groups if names]
    whole = getattr(method, "whole_layer", False)
    if whole and groups:
        every = [n for _, names in groups for n in names]
        _observe(method, layer, every, groups[-1][0].linears[-1], lambda: run(keep=False))
    for group, names in groups:
        if not whole:
            _observe(method, layer, names, group.linears[-1], lambda: run(keep=False))
        records.update(method.process_group(i, layer, group, names))
    records.update(method.finish_layer(i, layer))
    return records


def calibrate_layers(
    model: nn.Module,
    input_ids: torch.Tensor,
    method: LayerMethod,
    *,
    device: str | torch.device = "cpu",
    ignore: Callable[[str], bool] = lambda name: False,
    checkpoint_dir: Path | None = None,
    fingerprint: str = "",
    progress: Callable[[int, int], None] | None = None,
    batch_size: int = 8,
    warn: Callable[[str], None] = lambda msg: None,
) -> DriverResult:
    """Run `method` over every decoder layer of `model` on input_ids [N, S]: our own
    LlamaForCausalLM or the transformers wrapper (llmctl.compress.layer_runners says how each
    is walked; records are keyed by the checkpoint's linear names).

    progress(done_layers, total_layers) is called after each layer. With `checkpoint_dir`, a
    previous run with the same `fingerprint` is resumed from its last finished layer (a damaged
    checkpoint is redone, with a warning).
    """
    runner = runner_for(model)
    layers = runner.layers
    n_layers = len(layers)
    result = DriverResult()
    start = 0
    hidden = None
    if checkpoint_dir is not None:
        shape = (*input_ids.shape, runner.hidden_size)
        start, hidden, records = checkpoints.load(checkpoint_dir, fingerprint, layers, shape, warn)
        result.records.update(records)
        result.resumed_layers = start
    first = runner.start(input_ids, batch_size)  # also what the runner records of the inputs
    hidden = first if hidden is None else hidden
    if progress and start:
        progress(start, n_layers)
    for i in range(start, n_layers):
        layer = layers[i]
        home = next(layer.parameters()).device
        layer.to(device)

        run = functools.partial(_run_layer, runner, i, layer, hidden, device, batch_size)
        groups = runner.groups(i, layer, hidden[:batch_size], device)
        records = _calibrate_layer(i, layer, method, ignore, run, groups, runner.prefix)
        result.records.update(records)
        hidden = run(keep=True)
        layer.to(home)
        if checkpoint_dir is not None:
            prefix = f"{runner.prefix}.{i}."
            checkpoints.save(checkpoint_dir, fingerprint, i, layer, result.records, hidden, prefix)
        if progress:
            progress(i + 1, n_layers)
    return result


def _observe(
    method: LayerMethod,
    layer: nn.Module,
    names: list[str],
    last: str,
    run: Callable[[], None],
) -> None:
    """Run the layer forward (`run`) with hooks that hand the inputs of linears `names` to
    `method`; linear `last` (relative name) stops the forward before its own product: neither
    its output nor later parts are needed yet."""
    hooks = [
        layer.get_submodule(relative_name(n)).register_forward_pre_hook(
            _observer(method, n, stop=n.endswith(last))
        )
        for n in names
    ]
    if not names[-1].endswith(last):
        hooks.append(layer.get_submodule(last).register_forward_pre_hook(_stopper))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()


class _StopForward(Exception):
    """Raised by a hook once a group's inputs are all seen; caught per mini-batch."""


def _stopper(module, inputs):
    raise _StopForward


def _observer(method: LayerMethod, name: str, stop: bool):
    def hook(module, inputs):
        method.observe(name, inputs[0].detach())
        if stop:
            raise _StopForward

    return hook


GroupFn = Callable[[list[str], list[nn.Linear], torch.Tensor], dict[str, Any]]


class HessianMethod:
    """LayerMethod for per-linear methods that need H = 2 X X^T / n of each linear's inputs.

    fn(name, linear, H) changes linear.weight in place and returns the record for `name`.
    Linears that read one input tensor (q/k/v, gate/up) share one accumulator, so each batch
    costs one X^T X product for the group, not one per linear; group_fn(names, linears, H),
    when given, then handles such a group in one call (GPTQ quantizes their stacked rows at once).
    whole_layer: every linear's H from one pass over the layer before any is changed (one
    forward per layer instead of one per sub-layer group; llm-compressor's pipeline).
    """

    def __init__(
        self,
        fn: Callable[[str, nn.Linear, torch.Tensor], Any],
        group_fn: GroupFn | None = None,
        *,
        whole_layer: bool = False,
    ):
        self.fn, self.group_fn = fn, group_fn
        self.whole_layer = whole_layer  # observe the whole layer in one pass (see _calibrate_layer)
        self.acc: dict[str, HessianAccumulator] = {}
        self.followers: set[str] = set()  # linears whose accumulator is another's
        # the last input seen and its linear; holding x keeps its memory from being reused, so an
        # equal data pointer below means the very same tensor
        self._last: tuple[torch.Tensor, str] | None = None
        self._most = 0  # the most tokens any linear of this layer has seen (see `starved`)

    def observe(self, name: str, x: torch.Tensor) -> None:
        last, self._last = self._last, (x, name)
        if last is not None and last[1] != name and same_tensor(last[0], x):
            shared = self.acc[last[1]]
            if self.acc.setdefault(name, shared) is not shared:
                raise LlmctlError(f"{name}: its input was shared in one batch and not in another")
            self.followers.add(name)
            return
        if name in self.followers:
            raise LlmctlError(f"{name}: its input was shared in one batch and not in another")
        if name not in self.acc:
            self.acc[name] = HessianAccumulator(x.shape[-1], device=x.device)
        self.acc[name].add(x)
        self._most = max(self._most, self.acc[name].num_tokens)

    def process_group(
        self, layer_index: int, layer: nn.Module, group: SubLayerGroup, names: list[str]
    ) -> dict[str, Any]:
        self._last = None
        self.followers.difference_update(names)
        accs = [self.acc.pop(name, None) for name in names]
        # the linears by shared input (q/k/v; one expert's gate/up in a group of all experts')
        shared: dict[object, list[int]] = {}
        for k, a in enumerate(accs):
            shared.setdefault(id(a) if a is not None else ("unseen", k), []).append(k)
        records: dict[str, Any] = {}
        for ks in shared.values():
            some = [names[k] for k in ks]
            linears = [layer.get_submodule(relative_name(n)) for n in some]
            acc = accs[ks[0]]
            # starved: H = I (GPTQ becomes round-to-nearest, SparseGPT magnitude pruning)
            H = torch.eye(linears[0].in_features) if starved(acc, self._most) else acc.H
            if self.group_fn is not None and len(some) > 1:
                records.update(self.group_fn(some, linears, H))
            else:
                records.update({n: self.fn(n, lin, H) for n, lin in zip(some, linears)})
        return records

    def finish_layer(self, layer_index: int, layer: nn.Module) -> dict[str, Any]:
        self._most = 0
        return {}


MIN_ROUTED_TOKENS = 64  # calibration tokens an MoE expert needs for statistics of its own


def starved(acc: Any, most: int) -> bool:
    """The starved-expert rule, the one place it lives: a linear that saw no calibration token,
    or fewer than MIN_ROUTED_TOKENS and fewer than the layer's busiest linear (an MoE expert few
    tokens were routed to), has statistics that are noise, so it is handled as if it had none:
    H = I for the Hessian methods (GPTQ then is round-to-nearest with GPTQ's ranges, SparseGPT
    magnitude pruning), equal input norms for Wanda (magnitude); magnitude pruning and RTN read
    no data anyway. A linear every token reaches is never starved, however small the
    calibration set."""
    if acc is None:
        return True
    tokens = getattr(acc, "num_tokens", getattr(acc, "tokens", 0))
    return tokens < MIN_ROUTED_TOKENS and tokens < most
