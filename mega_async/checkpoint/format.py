"""Run checkpoints: everything a run needs to continue exactly, written atomically.

    <run_dir>/checkpoints/step_<N>/      (written as step_<N>.partial, renamed when complete)
        model/            Megatron distributed checkpoint: model + optimizer (fully reshardable: any layout)
        trainer.json      step, weight version, LR schedule, layout
        rng/rank<R>.pt    Python and torch RNG states of every trainer rank
        rollout.pt        rank 0: dataset position, staleness counters, every rollout waiting, running (tokens,
                          logprobs, versions so far) or finished and not consumed; ledger and metrics sizes
        manifest.json     size and sha256 of every other file, written last, checked first

Files read back are untrusted (mega_async.utils.safe_load): the distributed checkpoint's pickled `.metadata` goes
through an unpickler that admits only checkpoint-metadata classes, its object entries and every torch file are
loaded with `weights_only=True`, NaN/inf weights are refused as they are read. A resume checks the whole
checkpoint before anything starts (mega_async.checkpoint.check.validate_checkpoint).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch

from mega_async.checkpoint.check import (check_model_dir, check_run_dir, read_trainer_json, validate_checkpoint,
                                         write_manifest)
from mega_async.utils.diskspace import DiskFull, free_bytes, human, out_of_space
from mega_async.utils.lifeline import guard_checkpoint_writer
from mega_async.utils.safe_load import CheckpointError, dist_load, safe_torch_load

__all__ = ["CheckpointError", "check_dist_checkpoint", "checkpoint_path", "checked_resume_point", "latest_checkpoint",
           "load_checkpoint", "reset_run_dir", "resume_point", "save_checkpoint"]

logger = logging.getLogger("mega_async.checkpoint.format")

CKPT_DIR = "checkpoints"
_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}  # reloadable at another layout


# ---- where ------------------------------------------------------------------------------------------
def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CKPT_DIR / f"step_{step:08d}"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (a `.partial` directory is a write that did not finish)."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [d for d in root.iterdir() if d.is_dir() and d.name.startswith("step_") and d.name[5:].isdigit()
             and (d / "trainer.json").is_file()]
    return sorted(found, key=lambda d: int(d.name[5:]))


def latest_checkpoint(run_dir: str | Path) -> Optional[Path]:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


# ---- untrusted files: mega_async.utils.safe_load (readers), mega_async.checkpoint.check (the whole checkpoint) ----
check_dist_checkpoint = check_model_dir  # the model/ part of a checkpoint, before any library unpickles it


# ---- model + optimizer ----------------------------------------------------------------------------------
def _sharded(m: torch.nn.Module) -> dict:
    """A chunk's sharded state dict. A pipeline stage holding MTP layers but not the embedding (the last, at PP > 1)
    keeps a copy of the embedding, which Megatron ties to the first stage's over the DP x CP group it is told."""
    inner = m
    while hasattr(inner, "module"):
        inner = inner.module
    if getattr(inner, "mtp_process", False) and not getattr(inner, "pre_process", True):
        from megatron.core import parallel_state as mpu

        return m.sharded_state_dict(metadata={"dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)})
    return m.sharded_state_dict()


def model_sharded_state_dict(models: Sequence[torch.nn.Module]) -> dict:
    """{"model": ...} (or "model<i>" per virtual pipeline chunk), the Megatron way."""
    if len(models) == 1:
        return {"model": _sharded(models[0])}
    from megatron.core import parallel_state as mpu

    out = {}
    for i, m in enumerate(models):
        mpu.set_virtual_pipeline_model_parallel_rank(i)
        out[f"model{i}"] = _sharded(m)
    mpu.set_virtual_pipeline_model_parallel_rank(0)
    return out


def _train_state_dict(engine: Any, loading: bool) -> dict:
    if loading:  # a fresh optimizer has no Adam state yet to load into: create it (the checkpoint overwrites it)
        for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
            if not opt.optimizer.state and hasattr(opt, "_init_optimizer_states_with_dummy_values"):
                opt._init_optimizer_states_with_dummy_values()
    sd = model_sharded_state_dict(engine.models)
    model_sd = {k: v for k, v in sd.items()}
    sd["optimizer"] = engine.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=_SHARDING)
    return sd


def _rng_state() -> dict[str, Any]:
    st = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in st["python"]))
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(run_dir: str | Path, step: int, engine: Any, version: int, allocation: str,
                    rollout_state: Optional[dict] = None, keep: int = 2, extra: Optional[dict] = None) -> Path:
    """Every trainer rank calls it after step `step` (and its weight sync); rank 0 passes the rollout state.
    The directory appears under its final name only when every part is written.

    Raises DiskFull (on every rank) when the disk cannot hold it: before writing, when the free space is less
    than the state dict needs (agreed by all ranks); after a write that ran out of space, in place of the
    writer's own error (torch's says `unexpected pos 704 vs 598`). Older checkpoints are untouched either way and
    the partial write is removed."""
    from megatron.core import dist_checkpointing

    final = checkpoint_path(run_dir, step)
    tmp = final.with_name(final.name + ".partial")
    rank = _rank()
    sd = _train_state_dict(engine, loading=False)
    needed, free = _space_check(final, sd, rollout_state)
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "model").mkdir(parents=True)
            (tmp / "rng").mkdir()
        _barrier()
        guard_checkpoint_writer()  # Megatron's writer process ends with this one, even under kill -9
        dist_checkpointing.save(sd, str(tmp / "model"))
        torch.save(_rng_state(), tmp / "rng" / f"rank{rank}.pt")
        _barrier()  # every rank's files are written: rank 0 seals them
        if rank == 0:
            _seal(tmp, step, engine, version, allocation, rollout_state, extra)
    except BaseException as e:  # torch's CheckpointException is a BaseException
        left = free_bytes(tmp)
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or not (
                out_of_space(e) or (left is not None and left < min(needed, 64 << 20))):
            raise
        if rank == 0:  # the partial write goes (it holds the space the logs need); older checkpoints stay
            shutil.rmtree(tmp, ignore_errors=True)
        raise _disk_full(final, needed, free, during=_first_cause(e)) from e
    _barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        prune_checkpoints(run_dir, keep)
    _barrier()
    return final


def _seal(tmp: Path, step: int, engine: Any, version: int, allocation: str, rollout_state: Optional[dict],
          extra: Optional[dict]) -> None:
    """Rank 0, once every rank's files are written: the rollout state, trainer.json, and the manifest last."""
    if rollout_state is not None:
        torch.save(rollout_state, tmp / "rollout.pt")
    meta = {"step": step, "version": version, "allocation": allocation,
            "scheduler": engine.scheduler.state_dict(), "world_size": _world(),
            "optimizers": _n_optimizers(engine), **(extra or {})}
    _write_json(tmp / "trainer.json", meta)
    write_manifest(tmp)  # last: sizes and sha256 of every file, checked first on resume


# what each saved item costs beyond its bytes (torch's per-tensor record in the .distcp files, its entry in
# .metadata): measured 2.0-2.4 kB on the tiny run's checkpoint (452 items, 6.1 MB of tensors, 7.2 MB on disk)
ITEM_OVERHEAD = 2560
SPACE_MARGIN = 64 << 10  # and this much beside, for trainer.json, the manifest and the RNG files


def state_bytes(obj: Any) -> int:
    """About how many bytes `obj` (a Megatron sharded state dict, or any nest of dicts, lists and tensors) takes
    on disk: the main replica's tensors (a factory's source tensor), plus ITEM_OVERHEAD per item."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory, \
        is_main_replica

    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    if isinstance(obj, ShardedTensor):
        data = obj.data
        main = is_main_replica(obj.replica_id)
        return ITEM_OVERHEAD + (data.numel() * data.element_size() if main and data is not None else 0)
    if isinstance(obj, ShardedTensorFactory):
        return ITEM_OVERHEAD + obj.data.numel() * obj.data.element_size()
    if isinstance(obj, ShardedObject):
        return ITEM_OVERHEAD
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (str, bytes)):
        return len(obj)
    return 16


def _space_check(final: Path, sd: dict, rollout_state: Optional[dict]) -> tuple[int, Optional[int]]:
    """(bytes the checkpoint needs over all ranks, the least free space any rank sees where it goes); raises
    DiskFull on every rank when that is too little (every rank decides on the same numbers)."""
    import torch.distributed as dist

    mine = state_bytes(sd) + (state_bytes(rollout_state) if rollout_state is not None else 0)
    free = free_bytes(final.parent)
    every = [(mine, free)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (mine, free))
    needed = sum(m for m, _ in every) + SPACE_MARGIN
    frees = [f for _, f in every if f is not None]
    free = min(frees) if frees else None
    if free is not None and free < needed:
        raise _disk_full(final, needed, free)
    return needed, free


def _first_cause(e: BaseException) -> str:
    """The writer's own error in one line: a rank's failure inside torch's CheckpointException (whose message
    is only `CheckpointException ranks:dict_keys([0])`), else `e`."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, f = next(iter(failures.items()))
        inner = f[0] if isinstance(f, tuple) else f
        if isinstance(inner, BaseException):
            return f"rank {rank}: {_first_cause(inner)}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _disk_full(final: Path, needed: int, free: Optional[int], during: Optional[str] = None) -> DiskFull:
    """The one-line error: where, what it needs against what is free, that older checkpoints are intact."""
    newest = latest_checkpoint(final.parent.parent)
    when = f"was free when it began (the disk filled up during the write; the writer said {during})" if during \
        else "is free there, so it was not started"
    return DiskFull(f"checkpoint {final.name} not written: no space left on device in {final.parent} (the disk is "
                    f"full): the checkpoint needs about {human(needed)} (estimated from its state dict), "
                    f"{human(free)} {when}; older checkpoints are intact (newest: "
                    f"{newest.name if newest else 'none yet'}; a new one is written before the oldest of "
                    "trainer.keep_checkpoints is deleted): free space there, then continue with --resume",
                    final.parent, needed=needed, free=free)


def load_checkpoint(path: str | Path, engine: Any) -> dict[str, Any]:
    """Load model, optimizer, LR schedule and (same world size) RNG states into `engine` on every rank; returns
    trainer.json's content plus `rollout` (rank 0, when saved)."""
    p = Path(path)
    meta = read_trainer_json(p / "trainer.json")
    check_dist_checkpoint(p / "model")
    if meta.get("optimizers", 1) != _n_optimizers(engine):
        raise CheckpointError(f"{p} was written at {meta.get('allocation')}, whose optimizer has "
                              f"{meta.get('optimizers')} parts (dense, experts); this layout's has {_n_optimizers(engine)}: "
                              "resume with expert parallelism on (e > 1) or off on both sides")
    # the config's schedule wins (e.g. a larger trainer.total_steps); the step count comes from the checkpoint
    engine.scheduler.override_opt_param_scheduler, engine.scheduler.use_checkpoint_opt_param_scheduler = True, False
    state = dist_load(_train_state_dict(engine, loading=True), p / "model")  # NaN/inf refused as read
    for key, m in zip(sorted(k for k in state if k.startswith("model")), engine.models):
        res = m.load_state_dict(state[key], strict=False)  # Transformer Engine's _extra_state may be absent
        missing = [k for k in res.missing_keys if not k.endswith("_extra_state")]
        if missing:
            raise CheckpointError(f"{p}: the checkpoint lacks {len(missing)} weights of this model, e.g. {missing[0]}")
    with _torch_adam_step_fix(engine.optimizer):
        engine.optimizer.load_state_dict(state["optimizer"])
    engine.scheduler.load_state_dict(meta["scheduler"])
    rng = p / "rng" / f"rank{_rank()}.pt"
    if meta["world_size"] == _world():
        _set_rng_state(safe_torch_load(rng))  # missing: refused (a same-size resume restores every rank's RNG)
    else:
        logger.info("checkpoint written at %s ranks, resuming at %s: RNG states start fresh", meta["world_size"],
                    _world())
    if _rank() == 0 and (p / "rollout.pt").is_file():
        meta["rollout"] = safe_torch_load(p / "rollout.pt")
    return meta


@contextlib.contextmanager
def _torch_adam_step_fix(optimizer: Any) -> Iterator[None]:
    """Two Megatron-Core 0.16 bugs with torch's Adam (no Apex/TE) when loading a `fully_reshardable` optimizer
    state: Adam's "step" is left out of the per-parameter tensors (it comes from the param groups) and then
    indexed (KeyError): during the load, copy only the tensors the checkpoint has; and every parameter's state
    gets the *same* step tensor, which Adam's in-place increment then advances once per parameter (wrong bias
    correction from the next step on): give each its own copy."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    orig = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_present(self: Any, model_param: Any, tensors: dict) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return orig(self, model_param, tensors)
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in tensors.items():
            dst[key].copy_(value)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_present  # type: ignore[method-assign]
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = orig  # type: ignore[method-assign]
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for st in opt.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()


def prune_checkpoints(run_dir: str | Path, keep: int) -> None:
    found = complete_checkpoints(run_dir)
    for d in found[:-keep] if keep > 0 else []:
        shutil.rmtree(d, ignore_errors=True)
    for d in (Path(run_dir) / CKPT_DIR).glob("*.partial"):
        shutil.rmtree(d, ignore_errors=True)


def _n_optimizers(engine: Any) -> int:
    return len(getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]))


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


# ---- the run directory ----------------------------------------------------------------------------------
RUN_FILES = ("metrics.jsonl", "rollouts.jsonl", CKPT_DIR, "weights", "final_hf")


def resume_point(run_dir: str | Path, mode: str) -> Optional[Path]:
    """The checkpoint to continue from under `trainer.resume=mode`, or None for a fresh start. Raises
    CheckpointError (one line) when starting would mix two runs or `require` finds no checkpoint."""
    d = Path(run_dir)
    check_run_dir(d)  # no link out of it is followed, truncated or deleted
    latest = latest_checkpoint(d)
    used = [f for f in RUN_FILES if (d / f).exists()]
    if mode == "never" and used:
        raise CheckpointError(f"run directory {d} already holds a run ({', '.join(used)}): pass --resume (or "
                              "trainer.resume=auto) to continue it, or choose another trial_name")
    if mode == "require" and latest is None:
        raise CheckpointError(f"--resume: no complete checkpoint under {d / CKPT_DIR} (trainer.save_interval "
                              "sets how often they are written)")
    return latest


def checked_resume_point(cfg: Any, world: int) -> Optional[Path]:
    """`resume_point` for `cfg`, and the checkpoint checked as a whole for a resume at `world` trainer ranks
    (before any server or rank starts work). Raises CheckpointError (one line)."""
    found = resume_point(cfg.run_dir, cfg.trainer.resume)
    if found is not None:
        validate_checkpoint(found, cfg, world)
    return found


def reset_run_dir(run_dir: str | Path, checkpoint: Optional[Path]) -> None:
    """Before a (re)start on rank 0: cut metrics, ledger and event timeline back to what the checkpoint saw
    (everything after it is redone), drop weight versions newer than it and unfinished checkpoint writes."""
    from mega_async.rollout.ledger import Ledger

    d = Path(run_dir)
    sizes = {"metrics.jsonl": 0, "rollouts.jsonl": 0, "events.jsonl": 0}
    version = 0
    if checkpoint is not None:
        meta = json.loads((checkpoint / "trainer.json").read_text())  # checked by checked_resume_point
        if not all(isinstance(meta.get(k, 0), int) and meta.get(k, 0) >= 0
                   for k in ("metrics_bytes", "ledger_bytes", "events_bytes", "version")):
            raise CheckpointError(f"{checkpoint / 'trainer.json'}: sizes and version must be integers >= 0")
        sizes = {"metrics.jsonl": meta["metrics_bytes"], "rollouts.jsonl": meta["ledger_bytes"]}
        if "events_bytes" in meta:  # checkpoints written before the timeline was recorded keep it whole
            sizes["events.jsonl"] = meta["events_bytes"]
        version = meta["version"]
    for name, size in sizes.items():
        Ledger.truncate(d / name, size)
    for w in (d / "weights").glob("v*"):
        if w.is_dir() and (not w.name[1:].isdigit() or int(w.name[1:]) > version or checkpoint is None):
            shutil.rmtree(w, ignore_errors=True)
    shutil.rmtree(d / "final_hf", ignore_errors=True)
    for p in (d / CKPT_DIR).glob("*.partial"):
        shutil.rmtree(p, ignore_errors=True)
