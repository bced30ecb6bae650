"""LoRA on any linear module, several adapters in one forward pass (punica / S-LoRA style).

Owns: `LoraLinear` (wraps a decoder projection, whatever module it is: our Linear, a quantized
or sparse one; holds every resident adapter's A and B for it, zero-padded to the engine's
max rank, slot 0 meaning no adapter), `LoraStep` (the step's adapter segments, one object shared
by every wrapper of a model and set by the engine's model runner before each forward), and
`wrap` / `unwrap` (swap wrappers in for the named linears, and back).

y = base(x) + scale_s * (x[rows_s] @ A_s.T) @ B_s.T for each adapter s present in the step:
the base matmul once for the whole batch, then one small GEMM pair per adapter over its rows
(rows of the base model are skipped). Wrapped projections are not `Linear`, so
models/merged.py keeps them out of a merged q/k/v or gate/up (the rest of the model is
unchanged), and the flat decode program does not build over them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

# the projections an adapter may target (PEFT's target_modules names)
TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraStep:
    """The adapters of the step about to run: (slot, packed rows) per adapter present, the rows a
    slice where they are contiguous, else a LongTensor of row indices. Empty: base only."""

    segments: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)


class LoraLinear(nn.Module):
    """`base` plus the low-rank update of each row's adapter (see the module docstring)."""

    def __init__(
        self, base: nn.Module, slots: int, max_rank: int, step: LoraStep, dtype, device
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        # [slots, max_rank, in] and [slots, out, max_rank] (B times the adapter's scale); slot 0
        # stays zero (no adapter)
        kw = dict(dtype=dtype, device=device)
        self.register_buffer("lora_a", torch.zeros(slots, max_rank, self.in_features, **kw), False)
        self.register_buffer("lora_b", torch.zeros(slots, self.out_features, max_rank, **kw), False)
        self.ranks = [0] * slots  # 0: this slot's adapter does not touch this module
        self.scales = [0.0] * slots
        self._step = [step]  # in a list: shared, not a submodule

    def load(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scale: float):
        """Put A [r, in] and B [out, r] in `slot` (None: the slot's adapter skips this module)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if a is None:
            self.ranks[slot], self.scales[slot] = 0, 0.0
            return
        r = a.shape[0]
        if a.shape[1] != self.in_features or b.shape[0] != self.out_features:
            raise ValueError(
                f"A {list(a.shape)} / B {list(b.shape)} do not fit a linear of in "
                f"{self.in_features}, out {self.out_features}"
            )
        self.lora_a[slot, :r].copy_(a)
        self.lora_b[slot, :, :r].copy_(b * scale)  # scale folded in: one op less a segment
        self.ranks[slot], self.scales[slot] = r, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        segments = self._step[0].segments
        if not segments:
            return y
        xf = x.reshape(-1, self.in_features)  # [T, in], packed rows
        yf = y.view(-1, self.out_features)  # [T, out], updated in place
        for slot, rows in segments:
            r = self.ranks[slot]
            if not r:
                continue
            a = self.lora_a[slot, :r]  # [r, in]
            b = self.lora_b[slot, :, :r]  # [out, r], scale included
            xa = xf[rows] @ a.T  # [rows, r]
            if isinstance(rows, slice):  # a view of y: updated in place by one fused call
                yf[rows].addmm_(xa, b.T)
            else:
                yf.index_add_(0, rows, xa @ b.T)  # [rows, out] added at their rows
        return y


def unwrap(root: nn.Module) -> int:
    """Put every wrapped linear's base module back; returns how many there were."""
    done = 0
    for name, module in list(root.named_modules()):
        if isinstance(module, LoraLinear):
            parent, _, child = name.rpartition(".")
            setattr(root.get_submodule(parent), child, module.base)
            done += 1
    return done


def wrap(
    root: nn.Module, targets: set[str] | None, slots: int, max_rank: int, dtype, device
) -> tuple[LoraStep, dict[str, LoraLinear]]:
    """Wrap each decoder linear of `root` (named as checkpoints name it) whose last name part is
    in `targets` (None: every projection of TARGETS); returns the shared step and the wrappers
    by full name."""
    unwrap(root)
    step = LoraStep()
    wanted = set(targets if targets is not None else TARGET_NAMES)
    wrappers: dict[str, LoraLinear] = {}
    for name, module in list(root.named_modules()):
        last = name.rpartition(".")[2]
        if last not in wanted or not hasattr(module, "in_features") or ".layers." not in name:
            continue
        wrapper = LoraLinear(module, slots, max_rank, step, dtype, device)
        parent = name.rpartition(".")[0]
        setattr(root.get_submodule(parent), last, wrapper)
        wrappers[name] = wrapper
    return step, wrappers
