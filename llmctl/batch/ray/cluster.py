"""The Ray connection of a `run-batch --ray` job.

Owns: `import_ray` (Ray Data, or the one-line error naming the extra), `connect` (the cluster this
process is already in, `--ray-address`, or a local cluster started for the job) and `RayCluster`,
which stops at the end of the job only what the job started.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

from llmctl.batch.options import BatchOptions
from llmctl.errors import UsageError

EXTRA = "pip install 'llmctl[ray]'"


def import_ray():
    """The `ray` module with Ray Data, or the one-line error naming the extra."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise UsageError(f"--ray needs Ray Data, which is not installed: {EXTRA}") from None
    return ray


@dataclass
class RayCluster:
    """The Ray connection of one job; `close` stops what the job started, nothing else."""

    ray: Any
    load_runtime: Callable[..., Any]
    started: bool

    def close(self) -> None:
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()
            self.started = False


def connect(opts: BatchOptions, load_runtime: Callable[..., Any], ui) -> RayCluster:
    """Join the cluster the process is already in, --ray-address, or a new local cluster."""
    r = opts.ray
    if opts.input == "-":
        raise UsageError("--ray reads the input in a Ray task: pass a file, not stdin")
    ray = import_ray()
    if ray.is_initialized():  # embedded use: the caller's cluster, left running
        return RayCluster(ray, load_runtime, started=False)
    quiet = {"logging_level": logging.WARNING, "log_to_driver": False}
    try:
        if r.address is not None:
            ray.init(address=r.address, **quiet)
            ui.info(f"Ray: connected to {r.address}")
        else:
            cpus = math.ceil(r.replicas * r.cpus_per_replica) + 1  # + the reading task
            gpus = math.ceil(r.replicas * r.gpus_per_replica)
            ray.init(num_cpus=cpus, num_gpus=gpus, include_dashboard=False, **quiet)
            ui.info(f"Ray: started a local cluster ({cpus} CPUs, {gpus} GPUs) for this job")
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = r.address or "a local cluster"
        raise UsageError(f"cannot start Ray ({where}): {str(e).splitlines()[0]}") from None
    return RayCluster(ray, load_runtime, started=True)
