"""Data-parallel training through torchrun, with no code change for the user.

Owns: `World` (rank, world size, and the few collective operations the loop needs) and
`init_world`: when torchrun's WORLD_SIZE is above 1, the process group is set up from its
environment variables (gloo on the CPU, nccl on CUDA) and each rank takes its own device; with
one process nothing is initialised and the collectives are no-ops.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mean(self, value: float) -> float:
        """The mean of a scalar over all ranks."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / self.size

    def total(self, value: int) -> int:
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t)
        return int(t.item())

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()

    def wrap(self, module: torch.nn.Module, device: str) -> torch.nn.Module:
        """DDP around `module` when there is more than one rank."""
        if self.size == 1:
            return module
        from torch.nn.parallel import DistributedDataParallel

        ids = [torch.device(device).index] if device.startswith("cuda") else None
        return DistributedDataParallel(module, device_ids=ids)


def init_world(device: str) -> tuple[World, str]:
    """(world, this rank's device) from torchrun's environment."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World(), device
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return World(rank=rank, size=size), device


def close_world(world: World) -> None:
    if world.size > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
