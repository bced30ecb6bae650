"""LoRA adapters inside the engine: which adapters are resident, in which slot, and each step's
adapter segments.

Owns: `Adapter` (one loaded adapter: plain tensors by module name, its scale, its content
digest; runtime/lora.py reads PEFT folders into it), `LoRARequest` (vLLM's spelling: name, int
id, path), and `LoraSlots`: wraps the model's target projections once when the engine starts
(models/lora.py), keeps up to `max_loras` adapters resident (slot 0 is the base model), loads
an adapter into a free slot when the scheduler admits a request that needs it (evicting the least
recently loaded one no running request uses; with every slot held the request waits), and turns
a step's (adapter, token count) list in packed order into the segments the wrappers read.
Adapters registered by name (run-batch's --lora-modules) are what a request's adapter name
resolves to; an unknown name is the request's `unknown_model`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.errors import RequestError, UsageError
from llmctl.models.linears import weights_root
from llmctl.models.lora import TARGET_NAMES, LoraLinear, LoraStep, unwrap, wrap

TARGETS = TARGET_NAMES


@dataclass(frozen=True, eq=False)
class Adapter:
    """A loaded LoRA adapter: module name (as checkpoints name it) -> (A [r, in], B [out, r])."""

    name: str
    path: str
    rank: int
    scale: float  # lora_alpha / r (or / sqrt(r) with use_rslora)
    weights: dict
    digest: str  # SHA-256 of its config and weights

    @property
    def targets(self) -> set[str]:
        return {m.rpartition(".")[2] for m in self.weights}

    @property
    def cache_root(self) -> tuple[str, str]:
        """The root its prefix-cache block hashes chain from (the base model's is None)."""
        return ("lora", self.digest)


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest(lora_name, lora_int_id, lora_path)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class LoraSlots:
    """See the module docstring. `targets`: the projection names to wrap (None: all of
    TARGETS, for adapters not known when the engine starts)."""

    def __init__(self, model, targets, max_loras: int, max_rank: int, device, dtype) -> None:
        if max_loras < 1 or max_rank < 1:
            raise UsageError("max_loras and max_lora_rank must be >= 1")
        self.max_rank, self.device = max_rank, device
        self.step: LoraStep
        root = weights_root(model)
        self.step, self.wrappers = wrap(root, targets, max_loras + 1, max_rank, dtype, device)
        self.slots: list[Adapter | None] = [None] * (max_loras + 1)  # [0] stays None: the base
        self.loaded_order: list[int] = []  # resident slots, least recently loaded first
        self.registered: dict[str, Adapter] = {}

    def register(self, adapter: Adapter) -> None:
        """Make `adapter` resolvable by its name (and check that it can be served)."""
        self._check(adapter)
        self.registered[adapter.name] = adapter

    def resolve(self, lora) -> Adapter | None:
        """A request's adapter: None (the base), an Adapter, or a registered adapter's name."""
        if lora is None or isinstance(lora, Adapter):
            if lora is not None:
                self._check(lora)
            return lora
        if lora not in self.registered:
            known = ", ".join(sorted(self.registered)) or "none"
            raise RequestError(
                "unknown_model", f"no LoRA adapter named {lora!r} (adapters: {known})"
            )
        return self.registered[lora]

    def _check(self, adapter: Adapter) -> None:
        if adapter.rank > self.max_rank:
            raise UsageError(
                f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, over max_lora_rank "
                f"{self.max_rank}"
            )
        missing = sorted(set(adapter.weights) - set(self.wrappers))
        if missing:
            raise UsageError(
                f"LoRA adapter {adapter.name!r} adapts {missing[0]}, which is not a projection "
                f"of this model wrapped for adapters"
            )
        for name, (a, b) in adapter.weights.items():
            w = self.wrappers[name]
            if a.shape[1] != w.in_features or b.shape[0] != w.out_features:
                raise UsageError(
                    f"LoRA adapter {adapter.name!r}: {name} is [{b.shape[0]} x {a.shape[1]}] in "
                    f"the adapter, [{w.out_features} x {w.in_features}] in this model (an adapter "
                    f"of another base model?)"
                )

    def activate(self, adapter: Adapter, in_use: set[str]) -> bool:
        """Make `adapter` resident: True where it is, or was loaded into a free slot or one
        whose adapter no running request uses (`in_use`: their digests); False where every
        slot is in use (the request waits)."""
        if any(a is not None and a.digest == adapter.digest for a in self.slots):
            return True
        free = [s for s in range(1, len(self.slots)) if self.slots[s] is None]
        idle = [s for s in self.loaded_order if self.slots[s].digest not in in_use]
        if not free and not idle:
            return False
        slot = free[0] if free else idle[0]
        if slot in self.loaded_order:
            self.loaded_order.remove(slot)
        self._load(slot, adapter)
        return True

    def gate(self, seq, running) -> bool:
        """The scheduler's `lora_gate`: `seq`'s adapter resident beside the running ones'."""
        return self.activate(seq.lora, {s.lora.digest for s in running if s.lora is not None})

    @torch.inference_mode()
    def _load(self, slot: int, adapter: Adapter) -> None:
        for name, wrapper in self.wrappers.items():
            a, b = adapter.weights.get(name, (None, None))
            if a is not None:
                a, b = a.to(wrapper.lora_a.dtype), b.to(wrapper.lora_bt.dtype)
            wrapper.load(slot, a, b, adapter.scale)
        self.slots[slot] = adapter
        self.loaded_order.append(slot)

    def set_step(self, rows: list[tuple[Adapter | None, int]]) -> None:
        """The step's (adapter, token count) per sequence, in packed order -> `step.segments`:
        per adapter, a slice where its rows are one run, else their indices [k]; and on the CPU
        `step.row_slot`, every row's slot (int32 [T])."""
        by_slot: dict[int, list[int]] = {}
        offset = 0
        slot_of = {a.digest: s for s, a in enumerate(self.slots) if a is not None}
        row_slot: list[int] = []
        for adapter, n in rows:
            slot = 0 if adapter is None else slot_of[adapter.digest]
            row_slot += [slot] * n
            if slot:
                by_slot.setdefault(slot, []).extend(range(offset, offset + n))
            offset += n
        segments: list = []
        for slot, idx in by_slot.items():
            if idx[-1] - idx[0] + 1 == len(idx):
                segments.append((slot, slice(idx[0], idx[-1] + 1)))
            else:
                segments.append((slot, torch.tensor(idx, dtype=torch.long, device=self.device)))
        self.step.segments = segments
        # every row's slot for the CPU kernel (kernels/cpu/lora.py): built once, read by all layers
        cpu = torch.device(self.device).type == "cpu"
        self.step.row_slot = torch.tensor(row_slot, dtype=torch.int32) if cpu and by_slot else None

    @property
    def modules(self) -> list[LoraLinear]:
        return list(self.wrappers.values())


def start_lora(model, cfg, device, dtype) -> LoraSlots | None:
    """The engine's adapter slots where `cfg.enable_lora` (the projections wrapped now, before
    the model runner prepares the model), else None with any wrappers of an earlier engine over
    the same model taken out."""
    if not cfg.enable_lora:
        unwrap(weights_root(model))
        return None
    targets = None if cfg.lora_targets is None else set(cfg.lora_targets)
    return LoraSlots(model, targets, cfg.max_loras, cfg.max_lora_rank, device, dtype)
