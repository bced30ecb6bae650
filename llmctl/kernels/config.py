"""Every kernel choice of an engine, in one frozen record passed down from where it is set.

Owns: `KernelConfig` and `from_env`. An engine's `EngineConfig.kernels` carries it: the command
line and `LLM()` set it (`--no-autotune`, `LLM(autotune=False)`), and where an `EngineConfig` is
made without one, the environment is read once then (`LLMCTL_KERNELS`, for A/B measurements:
comma-separated `field=value` pairs, e.g. `LLMCTL_KERNELS=native=0` or
`LLMCTL_KERNELS=decode_attention=dpbf16,prefill_attention=sdpa`). Nothing below reads the
environment: `models.prepare.prepare_for_inference` hands the record to the layers, and the
attention metadata carries it to the attention kernels.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping

from llmctl.errors import UsageError

ENV = "LLMCTL_KERNELS"
DECODE_ATTENTION = ("auto", "dpbf16", "generic")
PREFILL_ATTENTION = ("auto", "amx", "dpbf16", "sdpa")
# The KV cache dtypes, vLLM's spelling ("fp8" is e4m3), and int8 (a scale per token and head):
# kernels/kv_dtype.py maps them to torch's.
KV_CACHE_DTYPES = (
    "auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8",
)  # fmt: skip
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class KernelConfig:
    # The C kernels of kernels/cpu (off: PyTorch everywhere, as with no C compiler).
    native: bool = True
    # CPU linears timed at engine start, the fastest kernel per row count (kernels/cpu/linear).
    autotune: bool = True
    # q/k/v and gate/up as one linear each at inference (models/merged.py).
    merge_linears: bool = True
    # bf16 CPU steps on the lean path: the layers' forward methods called directly, without
    # nn.Module dispatch, on buffers shared by the step's layers (models/step.py).
    decode_program: bool = True
    # bf16 decode attention on the CPU: auto (AMX tiles where they run, else AVX512-BF16 where
    # it runs, else the generic kernel), dpbf16 (never AMX) or generic.
    decode_attention: str = "auto"
    # bf16 prefill attention on the CPU: auto, amx, dpbf16 (the C kernel's modes) or sdpa.
    prefill_attention: str = "auto"
    # Test only: CPU tensors through the batch-invariant Triton kernels (under TRITON_INTERPRET=1),
    # how the CUDA path is tested without a GPU (kernels/invariant.py).
    triton_on_cpu: bool = False

    def __post_init__(self) -> None:
        if self.decode_attention not in DECODE_ATTENTION:
            raise UsageError(f"decode_attention: one of {', '.join(DECODE_ATTENTION)}")
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise UsageError(f"prefill_attention: one of {', '.join(PREFILL_ATTENTION)}")

    @classmethod
    def parse(cls, text: str) -> KernelConfig:
        """`field=value[,field=value...]` (booleans as 1/0, true/false, yes/no, on/off)."""
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        values: dict[str, object] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = item.partition("=")
            name, value = name.strip(), value.strip()
            if not sep or name not in types:
                raise UsageError(f"{ENV}: unknown setting {item!r}; fields: {', '.join(types)}")
            if types[name] in ("bool", bool):
                if value.lower() not in _TRUE + _FALSE:
                    raise UsageError(f"{ENV}: {name} takes 1 or 0, got {value!r}")
                values[name] = value.lower() in _TRUE
            else:
                values[name] = value
        return cls(**values)


def from_env(environ: Mapping[str, str] | None = None) -> KernelConfig:
    """The record `LLMCTL_KERNELS` describes (defaults where unset)."""
    environ = os.environ if environ is None else environ
    return KernelConfig.parse(environ.get(ENV, ""))
