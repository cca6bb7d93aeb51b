"""A small run checkpoint for the checkpoint-damage and untrusted-file tests, written with the writers a run uses:
model/ by Megatron's `dist_checkpointing.save` (one weight and one `_extra_state` object, as a layer has),
rng/rank0.pt, rollout.pt and trainer.json in the layout `save_checkpoint` writes, and its manifest. A real
tiny run's checkpoint goes through the same checks in tests/integration/test_resume_damage.py (slow)."""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Iterator

import torch

from mega_async.checkpoint.format import _rng_state, checkpoint_path
from mega_async.checkpoint.check import run_record, write_manifest

WEIGHT = "decoder.layers.self_attention.linear_proj.weight"
EXTRA = "decoder.layers.self_attention.linear_proj._extra_state"
ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_cpu.yaml"


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A private 1-rank gloo group for Megatron's checkpoint functions (removed again if we made it)."""
    import torch.distributed as dist

    from mega_async.trainer.cpu import apply_cpu_patches
    from mega_async.trainer.parallel import init_distributed

    made = not dist.is_initialized()
    init_distributed("gloo")
    apply_cpu_patches()
    try:
        yield
    finally:
        if made and dist.is_initialized():
            dist.destroy_process_group()


def sharded_state_dict(weight: torch.Tensor) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    return {"model": {WEIGHT: ShardedTensor.from_rank_offsets(WEIGHT, weight),
                      EXTRA: ShardedObject(EXTRA, None, (1,), (0,), replica_id=0)}}


def save_model_dir(d: Path, weight: torch.Tensor | None = None) -> Path:
    from megatron.core import dist_checkpointing

    d.mkdir(parents=True)
    w = weight if weight is not None else torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dist_checkpointing.save(sharded_state_dict(w), str(d))
    return d


def rollout_state(seed: int) -> dict:
    """What RolloutHead.snapshot saves: executor episodes, dataset position, reward counters."""
    from mega_async.rollout.journal import CallRecord
    from mega_async.api.types import ModelResponse

    ep = {"tag": 0, "data": {"index": 3}, "head": 2, "state": "done", "journal": [],
          "result": {"input_ids": torch.ones(2, 5, dtype=torch.long), "rewards": torch.zeros(2)}}
    part = CallRecord([1, 2, 3], 16, ModelResponse([1, 2, 3], [7, 8], [-0.5, -0.25], [2, 3], "abort")).snapshot()
    running = {**ep, "tag": 1, "state": "running", "journal": [part], "result": None}
    return {"executor": {"episodes": [ep, running, {**ep, "state": "waiting", "head": None, "result": None}],
                         "counts": {"accepted": 12}, "batches_out": 3, "staleness": {}, "accept": None},
            "loader": {"epoch": 0, "position": 14, "seed": seed, "size": 1024, "shuffle": 1},
            "rewards": {"sum": 1.0, "count": 12}}


def write_run_checkpoint(cfg, model_src: Path, step: int = 2) -> Path:
    """<cfg.run_dir>/checkpoints/step_<step>/ with every part and its manifest; metrics/ledger/timeline files."""
    run = Path(cfg.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "rollouts.jsonl", "events.jsonl"):
        (run / name).write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n')
    ck = checkpoint_path(run, step)
    shutil.copytree(model_src, ck / "model")
    (ck / "rng").mkdir()
    torch.save(_rng_state(), ck / "rng" / "rank0.pt")
    torch.save(rollout_state(cfg.seed), ck / "rollout.pt")
    scheduler = {"max_lr": 0.01, "lr_warmup_steps": 2, "num_steps": 3 * 8, "lr_decay_style": "constant",
                 "lr_decay_steps": 10, "min_lr": 0.0, "start_wd": 0.0, "end_wd": 0.0, "wd_incr_style": "constant",
                 "wd_incr_steps": 10}
    size = len('{"step": 0}\n{"step": 1}\n{"step": 2}\n')
    meta = {"step": step, "version": step + 1, "allocation": cfg.parallel.allocation, "scheduler": scheduler,
            "world_size": 1, "optimizers": 1, "ledger_bytes": size, "metrics_bytes": size, "events_bytes": size,
            **run_record(cfg)}
    (ck / "trainer.json").write_text(json.dumps(meta, indent=1))
    write_manifest(ck)
    return ck
