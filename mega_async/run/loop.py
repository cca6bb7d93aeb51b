"""The drivers. A training step is five calls, as slime's train.py reads:

    batch (rank 0 rolls out; advantages + DP shares) -> train -> push (the weight sync) -> record -> checkpoint

run_training: the RL loop, SPMD on every trainer rank; global rank 0 (the DP head) also owns the servers, the
rollout executor and the metrics (run/head.py). run_rollout: the rollout layer alone: the servers reload the
model card at each version (exercises interruption and the update path without a trainer).
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Callable, Optional

import torch

from mega_async.api.config import RunConfig
from mega_async.api.config_load import save_config
from mega_async.utils.events import EventLog
from mega_async.inference.service import InferenceService
from mega_async.rollout.executor import WorkflowExecutor
from mega_async.run.checkpointer import Checkpointer, Preempted
from mega_async.run.head import RolloutHead, next_batch, rollout_stats
from mega_async.run.metrics import Metrics
from mega_async.run.tasks import check_inputs, reward_for, rollout_parts, weights_ready, within_prompt_budget

__all__ = ["Preempted", "check_inputs", "reward_for", "run_rollout", "run_training", "within_prompt_budget"]

logger = logging.getLogger("mega_async.run.loop")


def run_training(cfg: RunConfig, stop_requested: Optional[Callable[[], bool]] = None,
                 resume_checked: bool = False) -> list[dict[str, float]]:
    """The RL loop on this trainer rank (all ranks run it; rank 0 returns the per-step history). Continues from
    a checkpoint per `trainer.resume` (checked whole first, unless the caller did: `resume_checked`);
    `stop_requested()` true on any rank: checkpoint, then raise Preempted."""
    import torch.distributed as dist

    from mega_async.trainer.engine import build_engine
    from mega_async.trainer.parallel import control_group, destroy_parallel_state, init_distributed
    from mega_async.trainer.sync import make_sync, run_version

    alloc = cfg.allocation()
    init_distributed()
    ctrl = control_group()  # batches and failure agreement: gloo, with a timeout longer than any rollout wait
    rank0 = dist.get_rank() == 0
    if rank0:
        weights_ready(cfg)  # a bad model.path fails here, before the run directory is written
    checkpointer = Checkpointer(cfg, ctrl, stop_requested)
    resume = checkpointer.resume_point(rank0, alloc.train.world_size, resume_checked)
    version = run_version(checkpointer.version_of(resume))  # the sync's: it alone writes it; the rest read views
    events = EventLog(cfg.run_dir / "events.jsonl", rank=dist.get_rank())  # every rank appends to the timeline
    cpu = not torch.cuda.is_available()
    if cpu:  # trainer ranks and servers share the host's cores: split them, never oversubscribe
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (2 * alloc.train.world_size)))
    engine = build_engine(cfg, alloc.train, version.view())
    meta = checkpointer.load(resume, engine)
    head = None
    with contextlib.ExitStack() as stack:
        stack.callback(events.close)
        if rank0:
            head = RolloutHead(cfg, version.view(), stack, checkpointer.start, cpu, events)
        sync = make_sync(cfg, engine, version, head.service if head else None, head.ex if head else None, ctrl,
                         events)
        stack.callback(sync.close)
        checkpointer.resume(meta, sync, head)
        for step in range(checkpointer.start, cfg.trainer.total_steps):
            batch = next_batch(head, cfg.algorithm, ctrl, sync)
            with events.span("train_step", step=step):
                train = batch.train_on(engine)
            with events.span("sync", phase="push", step=step):
                pushed = sync.push()
            if head is not None:
                head.record(step, batch, train, pushed)
            if checkpointer.after_step(step):
                break
        else:
            checkpointer.export_final()
    destroy_parallel_state()  # every rank got here: leave together
    checkpointer.raise_if_preempted()
    return head.metrics.history if head is not None else []


def run_rollout(cfg: RunConfig) -> list[dict[str, float]]:
    """Run `trainer.total_steps` rollout steps with weight-version bumps; returns per-step stats."""
    from mega_async.trainer.sync import reload_sync, RolloutSide, run_version

    version = run_version()
    events = EventLog(cfg.run_dir / "events.jsonl")  # the timeline; written from the first event on
    service = InferenceService(cfg, version.view(), events=events)  # a bad model.path fails here, before the run dir
    metrics = None
    try:
        save_config(cfg, cfg.run_dir)
        metrics = Metrics(cfg.run_dir, tensorboard=cfg.logging.tensorboard)
        data, workflow, flt = rollout_parts(cfg, service)
        with WorkflowExecutor.from_config(cfg.rollout, service.engine, workflow, should_accept=flt,
                                          version=version.view(), events=events) as ex:
            sync = reload_sync(version, RolloutSide(service.engine, ex), cfg.model.path,
                                    timeout=cfg.trainer.sync_timeout, events=events, interrupt=cfg.rollout.interrupt)
            try:
                for step in range(cfg.trainer.total_steps):
                    batch = ex.prepare_batch(data)
                    stat = metrics.log(step, rollout_stats(step, batch, ex, flt))
                    logger.info("step %d: %d groups, %d tokens, reward %.3f, max head staleness %d", step,
                                stat["groups"], stat["output_tokens"], stat["reward_mean"], stat["head_staleness_max"])
                    with events.span("sync", phase="push", step=step):
                        sync.push()
            finally:
                sync.close()
        return metrics.history
    finally:
        if metrics is not None:
            metrics.close()
        service.close()
        events.close()
