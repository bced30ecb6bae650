"""This machine's measured peaks (memory bandwidth, bfloat16 and float32 matmul FLOP/s), cached per
machine.

Owns: the measurements behind `profile --measure-machine` and the cache file `machine.json` in
llmctl's cache folder (llmctl/cache_dir.py), a JSON object keyed by
`environment.machine_key(device)` so a cached value is only reused on the same CPU model and
thread count, or the same GPU. Measured profiles divide by these peaks to report MBU and MFU.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmctl.cache_dir import cache_root
from llmctl.profiling.dtypes import canonical_dtype
from llmctl.profiling.environment import machine_key

CACHE_SCHEMA_VERSION = 2  # 2: float32 matmul peak added


@dataclass(frozen=True)
class MachinePeaks:
    key: str
    device: str
    memory_bandwidth: float  # bytes/s, best of read (sum) and copy (read + write bytes)
    matmul_flops_bf16: float  # FLOP/s of a square bf16 matmul, 2 n^3 per product
    matmul_flops_fp32: float  # the same in float32
    measured_at: str
    method: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def compute_peak(self, kv_dtype: str) -> float:
        """The matmul ceiling for a model in `kv_dtype` (float32, bfloat16, float16; the short
        spellings fp32, bf16, fp16 are read too): float32's for float32; for 16-bit dtypes the
        larger of the two, since a CPU without bf16 units does bf16 math on its float32 FMAs
        (llmctl's kernels do; PyTorch's bf16 matmul there is a slow path)."""
        if canonical_dtype(kv_dtype) == "float32":
            return self.matmul_flops_fp32
        return max(self.matmul_flops_bf16, self.matmul_flops_fp32)


def cache_path() -> Path:
    return cache_root() / "machine.json"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(torch.device(device))


def _best_time(fn, device: str, repeats: int) -> float:
    """Fastest of `repeats` timed calls after one warm-up call (seconds)."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(device: str, nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Bytes/s of reading (`sum`) and copying (`copy_`, counted as read + write) a `nbytes` float32
    tensor."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # pages touched up front
    dst = torch.empty_like(src)
    read_s = _best_time(lambda: src.sum(), device, repeats)
    copy_s = _best_time(lambda: dst.copy_(src), device, repeats)
    return {"read": src.numel() * 4 / read_s, "copy": 2 * src.numel() * 4 / copy_s}


def measure_matmul(device: str, n: int, repeats: int = 3, dtype: str = "bfloat16") -> float:
    """FLOP/s of an [n, n] x [n, n] matmul in `dtype` (2 n^3 FLOPs)."""
    import torch

    a = torch.randn(n, n, device=device).to(getattr(torch, dtype))
    b = torch.randn(n, n, device=device).to(getattr(torch, dtype))
    seconds = _best_time(lambda: a @ b, device, repeats)
    return 2 * n**3 / seconds


def measure_machine(
    device: str, nbytes: int | None = None, matmul_n: int | None = None
) -> MachinePeaks:
    """Measure now (about a second on CPU); sizes default to 256 MiB / n=1024 on CPU, 2 GiB /
    n=8192 on CUDA."""
    cuda = device.startswith("cuda")
    nbytes = nbytes or (2 * 1024**3 if cuda else 256 * 1024**2)
    matmul_n = matmul_n or (8192 if cuda else 1024)
    bw = measure_bandwidth(device, nbytes)
    flops = measure_matmul(device, matmul_n)
    fp32 = measure_matmul(device, matmul_n, dtype="float32")
    return MachinePeaks(
        key=machine_key(device),
        device=device,
        memory_bandwidth=max(bw.values()),
        matmul_flops_bf16=flops,
        matmul_flops_fp32=fp32,
        measured_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        method={
            "tensor_bytes": nbytes,
            "read_bytes_per_s": bw["read"],
            "copy_bytes_per_s": bw["copy"],
            "matmul_n": matmul_n,
            "note": "best of repeated runs after a warm-up",
        },
    )


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(data, dict) or data.get("schema_version") != CACHE_SCHEMA_VERSION:
        return {}
    return data


def save_peaks(peaks: MachinePeaks, path: Path | None = None) -> Path:
    """Store (replace) this machine's entry; other machines' entries are kept."""
    path = path or cache_path()
    data = _read_cache(path) or {"schema_version": CACHE_SCHEMA_VERSION, "machines": {}}
    data.setdefault("machines", {})[peaks.key] = peaks.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
    return path


def cached_peaks(device: str, path: Path | None = None) -> MachinePeaks | None:
    """This machine's cached peaks, or None when never measured here."""
    entry = _read_cache(path or cache_path()).get("machines", {}).get(machine_key(device))
    if not isinstance(entry, dict):
        return None
    try:
        return MachinePeaks(**entry)
    except TypeError:  # an entry written by another version
        return None
