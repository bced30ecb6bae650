"""Where and with what a record was measured: versions, device, CPU model and threads or GPU name,
date.

Owns: `environment()` (a plain dict every profile/estimate/eval record carries), `machine_key()`
(the key the machine-peaks cache uses) and `peak_memory` helpers (CPU peak RSS from /proc, CUDA max
allocated).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """'AMD EPYC 7B13' from /proc/cpuinfo; platform.processor() elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    """GPU name for cuda devices, CPU model otherwise."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return cpu_model()


def machine_key(device: str) -> str:
    """Cache key of a machine's measured peaks: device kind + name (+ thread count on CPU)."""
    import torch

    if device.startswith("cuda"):
        return f"cuda:{device_name(device)}"
    return f"cpu:{cpu_model()}:threads={torch.get_num_threads()}"


def environment(device: str, dtype: str | None) -> dict[str, Any]:
    """The environment block of a record. `device` is the resolved device ('cpu', 'cuda',
    'cuda:0')."""
    import torch

    from llmctl import __version__

    env: dict[str, Any] = {
        "llmctl_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(terse=True),
        "device": device,
        "dtype": dtype,
        "cpu_model": cpu_model(),
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "gpu_name": device_name(device) if device.startswith("cuda") else None,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import transformers

        env["transformers_version"] = transformers.__version__
    except ImportError:  # optional for records
        env["transformers_version"] = None
    if device.startswith("cuda"):
        env["cuda_version"] = torch.version.cuda
    return env


def reset_peak_memory(device: str) -> bool:
    """Reset the peak counter; True when the next `peak_memory` covers only what follows.

    CPU: writing 5 to /proc/self/clear_refs resets the peak RSS (VmHWM) on Linux."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats(torch.device(device))
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_memory(device: str) -> tuple[int | None, str]:
    """(bytes, what it is): CUDA max allocated, or CPU peak resident set size (VmHWM)."""
    if device.startswith("cuda"):
        import torch

        return int(
            torch.cuda.max_memory_allocated(torch.device(device))
        ), "cuda_max_memory_allocated"
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024, "cpu_peak_rss"
    except OSError:
        pass
    try:
        import resource

        return int(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        ) * 1024, "cpu_peak_rss_lifetime"
    except (ImportError, OSError):
        return None, "unavailable"
