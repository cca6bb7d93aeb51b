"""Rank 0's half of a run (the DP head): the servers, the dataset order, the rollout executor, the ledger, the
metrics and the evaluation. It hands each step's groups to the trainer's dispatch and records the step."""
from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from typing import Any, Callable, Optional

import torch

from mega_async.api.config import RunConfig
from mega_async.utils.events import EventLog, NullEventLog
from mega_async.inference.service import InferenceService
from mega_async.rollout.executor import WaitInterrupted, WorkflowExecutor
from mega_async.rollout.filters import DynamicFilter
from mega_async.run.evaluation import Evaluator
from mega_async.run.metrics import Metrics, RewardTracker, prefixed
from mega_async.run.tasks import reward_for, rollout_parts
from mega_async.trainer.dispatch import StepBatch, timed_share
from mega_async.utils.comm import from_rank0
from mega_async.api.types import VersionView

logger = logging.getLogger("mega_async.run.loop")  # the step lines are the driver's (the console's progress bar)


class RolloutHead:
    """Servers, dataset order, executor, ledger, metrics and evaluation of a training run (rank 0)."""

    def __init__(self, cfg: RunConfig, version: VersionView, stack: contextlib.ExitStack, start: int, cpu: bool,
                 events: Any = None):
        from mega_async.rollout.dataloader import EpochLoader
        from mega_async.rollout.ledger import Ledger

        self.cfg = cfg
        self.version = version
        self.events = events if events is not None else NullEventLog()
        self.service = InferenceService(cfg, version, weights_root=(cfg.run_dir / "weights"),
                                        cpu_share=0.5 if cpu else 1.0, events=events)
        stack.callback(self.service.close)
        self.metrics = Metrics(cfg.run_dir, tensorboard=cfg.logging.tensorboard, purge_step=start or None)
        stack.callback(self.metrics.close)
        self.ledger = Ledger(cfg.run_dir / "rollouts.jsonl")
        stack.callback(self.ledger.close)
        data, workflow, self.flt = rollout_parts(cfg, self.service)
        self.loader = EpochLoader(data, seed=cfg.seed, shuffle=cfg.data.shuffle)
        self.ex = stack.enter_context(WorkflowExecutor.from_config(cfg.rollout, self.service.engine, workflow,
                                                                   should_accept=self.flt, version=version,
                                                                   ledger=self.ledger, events=events))
        self.rewards = RewardTracker(self.flt)
        self.evaluator = Evaluator.from_config(cfg, self.service, reward_for(cfg))
        self._t0 = time.monotonic()

    def groups(self, interrupt: Optional[Callable[[], bool]] = None) -> Optional[list[dict]]:
        """The next consumer batch of groups (waits for the executor); None when `interrupt()` came true first."""
        self._t0 = time.monotonic()
        try:
            if self.cfg.rollout.stale_batches:  # the FIFO control: this version's groups first, the oldest out
                self.ex.fill(self.loader, interrupt=interrupt)
            return self.ex.prepare_batch(self.loader, interrupt=interrupt)
        except WaitInterrupted:
            return None

    def record(self, step: int, batch: StepBatch, train: dict[str, Any], sync: dict[str, Any]) -> dict[str, Any]:
        """The step's line in metrics.jsonl (and TensorBoard), the evaluation when due, the console line."""
        step_s = time.monotonic() - self._t0  # since this step's groups() began
        stat = self.metrics.log(step, {
            "version": self.version.value, "reward_mean": self.rewards.since_last(batch.reward),
            "batch_reward_mean": batch.reward, "rollout_wait_s": round(batch.rollout_wait_s, 3),
            "train_s": round(batch.train_s, 3), "step_s": round(step_s, 3),
            **prefixed("train", train), **prefixed("batch", batch.stats), **sync, **prefixed("executor", self.ex.stats),
            **prefixed("filter", self.flt.stats if self.flt else None),
            **prefixed("router", getattr(self.service.engine, "router_stats", lambda: None)()),
            **(self.evaluator.maybe_evaluate(step) if self.evaluator else {})})
        logger.info("step %d: reward %.3f, loss %.4f, %d tokens, grad norm %.3f, staleness %.2f, %.1fs", step,
                    stat["reward_mean"], train.get("loss", 0.0), train.get("tokens", 0), train.get("grad_norm", 0.0),
                    train.get("staleness", 0.0), stat["step_s"], extra={"progress_step": step})  # the progress bar
        return stat

    def snapshot(self, sync: Any) -> tuple[dict, dict]:
        """Under the pause bracket (nothing generates): every unconsumed rollout, the dataset position, the
        filter and reward counters, and the sizes of metrics, ledger and timeline. Returns (rollout state,
        trainer.json extras)."""
        with sync.pause_bracket():
            held = self.service.engine.settle(self.cfg.trainer.sync_timeout)  # aborted requests' outputs arrive
            if held:
                logger.info("checkpoint: %d requests still in flight after settling (normally sent as the pause "
                            "began, queued by the paused servers with no new tokens); their episodes are saved up "
                            "to their last received token and continue from there", held)
            state = {"executor": self.ex.snapshot(), "loader": self.loader.state_dict(),
                     "rewards": self.rewards.state_dict()}
            sizes = {"ledger_bytes": self.ledger.size(), "metrics_bytes": self.metrics.size()}
            if isinstance(self.events, EventLog):  # no timeline: nothing to cut back on resume
                sizes["events_bytes"] = self.events.size()
        return state, sizes

    def restore(self, state: dict, version: int) -> None:
        self.loader.load_state_dict(state["loader"])
        if "rewards" in state:
            self.rewards.load_state_dict(state["rewards"])
        self.ex.on_version_recovered(version)  # the staleness budget: version * B groups were consumed
        self.ex.restore(state["executor"])
        logger.info("resumed at version %d: %d rollouts restored (%d running, %d ready), dataset epoch %d "
                    "position %d", version, len(state["executor"]["episodes"]),
                    sum(e["state"] == "running" for e in state["executor"]["episodes"]),
                    sum(e["state"] == "done" for e in state["executor"]["episodes"]), state["loader"]["epoch"],
                    state["loader"]["position"])


def next_batch(head: Optional[RolloutHead], algorithm: Any, group: Any = None, sync: Any = None) -> StepBatch:
    """Every rank: rank 0's head rolls the step's groups out, the trainer's dispatch gives each rank its share."""
    t0 = time.monotonic()
    groups = await_groups(head, sync, group)
    return timed_share(groups, algorithm, group, rollout_wait_s=time.monotonic() - t0)


def await_groups(head: Any, sync: Any = None, group: Any = None) -> Optional[list[dict]]:
    """Every rank: rank 0's head waits for the step's groups (the other ranks get None). A server that came back
    behind the synced version (restarted, or down during a sync) while it waits, where only the trainer can bring
    it up to date (the distributed sync: `sync.catches_up`), is caught up by every rank first (`sync.catch_up()`,
    the current version's weights), then the wait goes on: with one server, no group could be generated before."""
    catches_up = sync is not None and getattr(sync, "catches_up", False)
    while True:
        groups = head.groups(sync.catch_up_due if catches_up else None) if head is not None else None
        if not catches_up or not from_rank0(groups is None, group):
            return groups
        sync.catch_up()


def rollout_stats(step: int, batch: list[dict], ex: WorkflowExecutor, flt: Optional[DynamicFilter]) -> dict:
    """A rollout-only step's stats (run_rollout: no trainer)."""
    heads = [int(g["versions"][g["loss_mask"].bool()].min()) for g in batch if g["loss_mask"].any()]
    rewards = torch.cat([g["rewards"] for g in batch])
    return {"groups": len(batch), "sequences": int(rewards.numel()),
            "output_tokens": sum(int(g["loss_mask"].sum()) for g in batch), "reward_mean": float(rewards.mean()),
            "head_staleness_max": max((step - h for h in heads), default=0),
            **{f"staleness_{k}": v for k, v in sorted(Counter(step - h for h in heads).items())},
            **prefixed("executor", ex.stats), **prefixed("filter", flt.stats if flt else None)}
