"""A standalone torch process group for weight broadcasts (trainer rank 0 -> server ranks).

Built directly on a TCPStore, so it never touches (or needs) the default process group: the
trainer keeps its own Megatron groups, each server joins only this one. gloo on CPU, nccl on GPU.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class WeightGroup:
    def __init__(self, backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                 group_name: str, timeout_s: float = 300.0):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.backend, self.rank, self.world_size, self.group_name = backend, rank, world_size, group_name
        self._store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0),
                                    timeout=timeout, wait_for_workers=True)
        prefix = dist.PrefixStore(group_name, self._store)
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            self._pg = dist.ProcessGroupNCCL(prefix, rank, world_size, opts)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._pg.broadcast(tensor, src).wait()

    def destroy(self) -> None:
        self._pg = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]
