"""Megatron process groups: torch.distributed from torchrun/srun or a private one-rank group, Megatron's
parallel state (TP, PP, VPP, CP, EP, ETP) on nccl or gloo, and their teardown.

The allocation grammar lives in `mega_async.allocation` (re-exported here for older imports).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from mega_async.allocation import (  # noqa: F401  (re-exported public names)
    INFERENCE_BACKENDS,
    TRAINER_BACKENDS,
    Allocation,
    AllocationError,
    AllocationPart,
    ParallelStrategy,
    as_strategy,
    parse_allocation,
    validate_for_model,
)


def init_distributed(backend: Optional[str] = None) -> None:
    """torch.distributed from torchrun's environment (or a 1-rank group when run as a plain process)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:  # srun: one task per rank
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise RuntimeError("srun with several tasks: export MASTER_ADDR (the first node) and MASTER_PORT")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:  # torchrun / Slurm
        if world > 1:  # gloo groups (the default on CPU, the control group always) across hosts
            from mega_async.comm import pin_gloo_interface

            pin_gloo_interface(os.environ["MASTER_ADDR"])
        dist.init_process_group(backend, rank=rank, world_size=world)
        return
    if world != 1:
        raise RuntimeError(f"WORLD_SIZE={world} but MASTER_ADDR/MASTER_PORT are unset: launch with torchrun")
    # a plain process: a private 1-rank group; the environment is left untouched, so child processes
    # (servers, converters) never inherit a port that this process holds
    from mega_async.comm import PORT_ATTEMPTS, free_port, lost_the_port

    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
            return
        except RuntimeError as e:  # the port was taken between free_port() and the store's bind: another one
            if attempt == PORT_ATTEMPTS or not lost_the_port(str(e)):
                raise


def control_group(timeout_s: float = 24 * 3600.0) -> Any:
    """A gloo group over all ranks with a long timeout for the driver's small object messages (batches,
    failure agreement): rank 0 may wait for rollouts much longer than NCCL's 10-minute watchdog allows.
    Collective: every rank calls it at the same point."""
    import datetime

    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def init_parallel_state(s: ParallelStrategy, backend: Optional[str] = None, seed: int = 1234) -> None:
    """Initialise Megatron's parallel state (TP, PP, VPP, CP, EP, ETP) on nccl (GPU) or gloo (CPU)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from mega_async.trainer.cpu import apply_cpu_patches

    apply_cpu_patches()
    init_distributed(backend)
    world = dist.get_world_size()
    if world != s.world_size:
        raise AllocationError(f"allocation {s} needs {s.world_size} ranks, torch.distributed has {world}")
    if mpu.model_parallel_is_initialized():
        return
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=s.tp,
        pipeline_model_parallel_size=s.pp,
        virtual_pipeline_model_parallel_size=s.vpp if s.vpp > 1 else None,
        context_parallel_size=s.cp,
        expert_model_parallel_size=s.ep,
        expert_tensor_parallel_size=s.etp,
    )
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel_state() -> None:
    """Tear down Megatron's groups and the default process group, all ranks together.

    Call it before a torchrun worker exits: a rank that leaves while gloo's threads are still alive
    aborts at interpreter shutdown ("terminate called without an active exception", SIGABRT)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

