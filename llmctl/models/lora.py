"""LoRA on any linear module, several adapters in one forward pass (punica / S-LoRA style).

Owns: `LoraLinear` (wraps a decoder projection, whatever module it is: our Linear, a quantized
or sparse one; holds every resident adapter's A and B for it, zero-padded to the engine's
max rank, slot 0 meaning no adapter), `LoraStep` (the step's adapter rows, one object shared
by every wrapper of a model and set by the engine's model runner before each forward),
`LoraMerged` (a merged q/k/v or gate/up over wrapped parts: models/prepare.py asks `refreshed`
for it) and `wrap` / `unwrap` (swap wrappers in for the named linears, and back).

y = base(x) + scale_s * (x[rows_s] @ A_s.T) @ B_s.T for each adapter s present in the step:
the base matmul once for the whole batch, then each row's low-rank update from its own adapter:
on the CPU one C call per projection for every adapter (kernels/cpu/lora.py, BGMV), elsewhere
one small GEMM pair per adapter over its rows (rows of the base model are skipped). The parts
of a merged q/k/v or gate/up keep their merged GEMM: each wrapped part's update goes into its
column slice of the merged output, so the layers (and the lean bf16 step, models/step.py) run
as without adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from llmctl.kernels import invariant
from llmctl.kernels.config import KernelConfig
from llmctl.kernels.cpu import lora as cpu_lora
from llmctl.models import merged as merging
from llmctl.models.layers import Linear

# the projections an adapter may target (PEFT's target_modules names)
TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraStep:
    """The adapters of the step about to run: (slot, packed rows) per adapter present, the rows a
    slice where they are contiguous, else a LongTensor of row indices (the PyTorch path), and
    every packed row's slot, int32 [T] (the C kernel's; None where no CPU kernel reads it).
    Empty segments: base only."""

    segments: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    row_slot: torch.Tensor | None = None


class LoraLinear(nn.Module):
    """`base` plus the low-rank update of each row's adapter (see the module docstring)."""

    kernels: KernelConfig = KernelConfig()  # the engine's, set by models/prepare.py

    def __init__(
        self, base: nn.Module, slots: int, max_rank: int, step: LoraStep, dtype, device
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        # [slots, max_rank, in] and [slots, max_rank, out] (B transposed, times the adapter's
        # scale); slot 0 stays zero (no adapter)
        kw = dict(dtype=dtype, device=device)
        self.register_buffer("lora_a", torch.zeros(slots, max_rank, self.in_features, **kw), False)
        self.register_buffer(
            "lora_bt", torch.zeros(slots, max_rank, self.out_features, **kw), False
        )
        self.ranks = [0] * slots  # 0: this slot's adapter does not touch this module
        self.rank_table = torch.zeros(slots, dtype=torch.int32)  # the same, for the C kernel
        self.scales = [0.0] * slots
        self._step = [step]  # in a list: shared, not a submodule

    def load(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scale: float):
        """Put A [r, in] and B [out, r] in `slot` (None: the slot's adapter skips this module)."""
        self.lora_a[slot].zero_()
        self.lora_bt[slot].zero_()
        if a is None:
            self.ranks[slot], self.scales[slot] = 0, 0.0
            self.rank_table[slot] = 0
            return
        r = a.shape[0]
        if a.shape[1] != self.in_features or b.shape[0] != self.out_features:
            raise ValueError(
                f"A {list(a.shape)} / B {list(b.shape)} do not fit a linear of in "
                f"{self.in_features}, out {self.out_features}"
            )
        self.lora_a[slot, :r].copy_(a)
        self.lora_bt[slot, :r].copy_((b * scale).T)  # scale folded in: one op less a row
        self.ranks[slot], self.scales[slot] = r, scale
        self.rank_table[slot] = r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        self.update(x, y)
        return y

    def invariant_forward(self, x: torch.Tensor, kernels: KernelConfig) -> torch.Tensor:
        """Batch-invariant mode (models/layers.project with fixed_order): the base through
        kernels/invariant.py, each row's update computed as if the row were alone."""
        base = self.base
        plain = type(base) is Linear
        w, b = (base.weight, base.bias) if plain else (None, None)
        y = invariant.linear(x, w, b, base, kernels)
        self.update(x, y, per_row=True)
        return y

    def update(self, x: torch.Tensor, y: torch.Tensor, per_row: bool = False) -> None:
        """y [..., out] (the base's output for x [..., in], or a column slice of a merged one)
        += each row's adapter update, in place. `per_row`: no row's arithmetic depends on the
        others (the C kernel's rows never do; PyTorch's then run one row a GEMM pair)."""
        step = self._step[0]
        if not step.segments:
            return
        xf = x.reshape(-1, self.in_features)  # [T, in], packed rows
        yf = y.view(-1, self.out_features)  # [T, out], updated in place
        slots = step.row_slot
        if slots is not None and self.kernels.native:
            buffers = self._buffers  # not nn.Module.__getattr__: this runs 7 times a layer
            a, bt = buffers["lora_a"], buffers["lora_bt"]
            if cpu_lora.use_lora_apply(xf, yf, a):
                cpu_lora.lora_apply(xf, yf, a, bt, slots, self.rank_table)
                return
        for slot, rows in step.segments:
            r = self.ranks[slot]
            if not r:
                continue
            a = self.lora_a[slot, :r]  # [r, in]
            bt = self.lora_bt[slot, :r]  # [r, out], scale included
            if per_row:  # [1, in] @ [in, r] @ [r, out] a row: one reduction order for any batch
                for i in range(yf.shape[0])[rows] if isinstance(rows, slice) else rows.tolist():
                    yf[i : i + 1].addmm_(xf[i : i + 1] @ a.T, bt)
            elif isinstance(rows, slice):  # a view of y: updated in place by one fused call
                yf[rows].addmm_(xf[rows] @ a.T, bt)  # [rows, r] @ [r, out]
            else:
                yf.index_add_(0, rows, (xf[rows] @ a.T) @ bt)  # [rows, out] added at their rows


def _plain(part: nn.Module) -> nn.Module:
    """The linear a merged weight is made of: a wrapper's base, else the part itself."""
    return part.base if isinstance(part, LoraLinear) else part


class MergedLoraLinear(nn.Module):
    """The merged linear of a block whose parts are wrapped: one GEMM over the merged weight
    (`base`), then each wrapped part's update into its columns of the output [T, sum of N]."""

    def __init__(self, base: Linear, parts: tuple[nn.Module, ...], sizes: tuple[int, ...]):
        super().__init__()
        self.base = base
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        # (wrapper, first column, columns) of each wrapped part; a plain tuple: not submodules
        self.updates = tuple(
            (p, start, n) for p, start, n in zip(parts, starts, sizes) if isinstance(p, LoraLinear)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base.forward(x)  # not registered anywhere: no hooks to run
        for part, start, n in self.updates:
            part.update(x, y[..., start : start + n])
        return y


@dataclass(frozen=True)
class LoraMerged(merging.Merged):
    """models/merged.Merged over parts some of which are wrappers: `linear` is their
    MergedLoraLinear, `pointers` the weights of the parts' linears (`_plain`)."""

    def live(self, *modules: nn.Module) -> bool:
        for m, part, ptr in zip(modules, self.parts, self.pointers):
            if m is not part or _plain(m).weight.data_ptr() != ptr:
                return False
            if m._forward_hooks or m._forward_pre_hooks:
                return False
            if _plain(m)._forward_hooks or _plain(m)._forward_pre_hooks:
                return False
        return len(modules) == len(self.parts)


def wrapped(parts) -> bool:
    """Whether any of a block's projections is a wrapper (`refreshed` merges them)."""
    return any(isinstance(p, LoraLinear) for p in parts)


def refreshed(current, parts) -> LoraMerged | None:
    """`current` where it still serves `parts` (wrappers, or plain Linears beside them), else a
    new merge of their linears (their weights become views of the merged one); None where those
    cannot merge (models/merged.mergeable)."""
    parts = tuple(parts)
    if isinstance(current, LoraMerged) and current.live(*parts):
        return current
    inner = merging.merge([_plain(p) for p in parts], Linear)
    if inner is None:
        return None
    linear = MergedLoraLinear(inner.linear, parts, inner.sizes)
    return LoraMerged(linear, parts, inner.sizes, inner.pointers)


def served(module: nn.Module) -> list[nn.Module]:
    """The linear modules that compute for `module` (a merged linear or a part): a
    MergedLoraLinear's base and a wrapper's base beside the module itself."""
    inner = getattr(module, "base", None)
    wraps = isinstance(module, (LoraLinear, MergedLoraLinear))
    return [module, inner] if wraps and inner is not None else [module]


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
