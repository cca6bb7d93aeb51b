"""Megatron process groups: torch.distributed from torchrun/srun or a private one-rank group, Megatron's
parallel state (TP, PP, VPP, CP, EP, ETP) on nccl or gloo, and their teardown.

The allocation grammar lives in `mega_async.api.allocation` (re-exported here for older imports).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from mega_async.api.allocation import (  # noqa: F401  (re-exported public names)
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
        if "MASTER_ADDR" not in os.environ or not ({"MASTER_PORT", PORT_FILE_ENV} & set(os.environ)):
            raise RuntimeError("srun with several tasks: export MASTER_ADDR (the first node) and MASTER_PORT, or "
                               f"{PORT_FILE_ENV} (a file on a shared filesystem where rank 0 publishes its port)")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    published = "MASTER_PORT" not in os.environ and PORT_FILE_ENV in os.environ and world > 1  # the Slurm job
    if "MASTER_ADDR" in os.environ and ("MASTER_PORT" in os.environ or published):  # torchrun / Slurm
        if world > 1:  # gloo groups (the default on CPU, the control group always) across hosts
            from mega_async.utils.comm import pin_gloo_interface

            pin_gloo_interface(os.environ["MASTER_ADDR"])
        if published:  # rank 0's store binds a port the kernel picks, and says which
            store = published_store(os.environ["MASTER_ADDR"], os.environ[PORT_FILE_ENV], rank, world)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world)
        return
    if world != 1:
        raise RuntimeError(f"WORLD_SIZE={world} but MASTER_ADDR/MASTER_PORT are unset: launch with torchrun")
    # a plain process: a private 1-rank group; the environment is left untouched, so child processes
    # (servers, converters) never inherit a port that this process holds
    from mega_async.utils.comm import PORT_ATTEMPTS, free_port, lost_the_port

    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
            return
        except RuntimeError as e:  # the port was taken between free_port() and the store's bind: another one
            if attempt == PORT_ATTEMPTS or not lost_the_port(str(e)):
                raise


PORT_FILE_ENV = "MEGA_ASYNC_MASTER_PORT_FILE"


def published_store(host: str, port_file: str, rank: int, world: int, timeout_s: Optional[float] = None) -> Any:
    """The ranks' rendezvous store without a port chosen in advance: rank 0 binds port 0 (the kernel picks a free
    one, so no other process can take it between choosing and binding, as with a MASTER_PORT asked for earlier)
    and writes it to `port_file` (a shared filesystem; written whole, then renamed); the other ranks wait for the
    file, at most `timeout_s` (MEGA_ASYNC_MASTER_PORT_WAIT, default 900 s), then connect."""
    import datetime
    import time
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    if timeout_s is None:
        try:
            timeout_s = float(os.environ.get("MEGA_ASYNC_MASTER_PORT_WAIT", 900))
        except ValueError:
            raise RuntimeError(f"MEGA_ASYNC_MASTER_PORT_WAIT={os.environ['MEGA_ASYNC_MASTER_PORT_WAIT']!r}: give "
                               "the seconds the other ranks wait for rank 0's port, e.g. 900") from None
    limit = max(default_pg_timeout, datetime.timedelta(seconds=timeout_s))  # the store's, as env:// gives it
    path = Path(port_file)
    if rank == 0:
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=limit, wait_for_workers=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(f"{store.port}\n")
        os.replace(tmp, path)
        return store
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            text = ""
        if text:
            if not text.isdigit() or not 0 < int(text) < 65536:
                raise RuntimeError(f"{port_file}: {text[:40]!r} is not a port; rank 0 writes its port there "
                                   f"({PORT_FILE_ENV}): remove the file and start the job again")
            return dist.TCPStore(host, int(text), world, is_master=False, timeout=limit)
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {rank}: rank 0 did not publish its rendezvous port in {port_file} within "
                               f"{timeout_s:g}s ({PORT_FILE_ENV}); see rank 0's log (driver.log)")
        time.sleep(0.2)


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

    from mega_async.trainer.cpu import apply_cpu_patches

    apply_cpu_patches()  # first: Megatron is imported with its CPU settings
    from megatron.core import parallel_state as mpu

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

