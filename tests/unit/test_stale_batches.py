"""rollout.stale_batches=k: synchronous training fed batches generated exactly k versions earlier (the FIFO
control of issue 35), and the claim that max_staleness=0 is the asynchronous machinery with nothing stale."""
import asyncio
import random

import pytest

from mega_async.api.config import ConfigError, RolloutConfig
from mega_async.inference.sim.simulated import SimulatedEngine
from mega_async.rollout.executor import WorkflowExecutor
from mega_async.rollout.filters import DynamicFilter
from mega_async.rollout.workflow import RolloutWorkflow


class VersionedWorkflow(RolloutWorkflow):
    """Records the version its episode started and ended under; every 3rd item's group has equal rewards
    (the dynamic filter drops it, so its budget goes to another item)."""

    def __init__(self, ex_box, seed=0):
        self.box, self.rng = ex_box, random.Random(seed)
        self.crossed = 0  # episodes that saw a version change while running

    async def arun_episode(self, engine, data):
        v0 = self.box[0].version
        await asyncio.sleep(self.rng.random() * 0.004)
        v1 = self.box[0].version
        self.crossed += v0 != v1
        rewards = [1.0, 1.0] if data["id"] % 3 == 0 else [0.0, 1.0]
        return {"id": data["id"], "gen_version": v0, "rewards": rewards}


def run(B, eta, steps, fifo):
    box = []
    wf = VersionedWorkflow(box)
    ex = WorkflowExecutor(SimulatedEngine(), wf, consumer_batch_size=B, max_staleness=eta,
                          should_accept=DynamicFilter(), poll_interval=0.05)
    box.append(ex)
    data = [{"id": i} for i in range(10_000)]
    heads, running_at_train = [], []
    with ex:
        for step in range(steps):
            if fifo:
                ex.fill(data)
            batch = ex.prepare_batch(data)
            running_at_train.append(ex.stats["running"])  # what would overlap the training step
            heads.append(sorted({g["gen_version"] for g in batch}))
            ex.set_version(step + 1)  # the push
    return heads, running_at_train, wf.crossed, ex.stats


@pytest.mark.parametrize("k", [1, 3])
def test_fifo_trains_batches_exactly_k_versions_old(k):
    steps, B = 9, 4
    heads, running, crossed, stats = run(B, k, steps, fifo=True)
    for step, h in enumerate(heads):
        assert h == [max(0, step - k)], (step, h)  # one generating version per batch: step - k (version 0 early on)
    assert running == [0] * steps and crossed == 0  # nothing generates while a step trains
    assert stats["filtered"] > 0  # the filter dropped groups, and batches still came from one version
    assert stats[f"consumed_staleness_{k}"] == (steps - k) * B


def test_sync_is_the_async_machinery_with_nothing_stale():
    """max_staleness=0 through the same executor: every batch is the current version's, nothing is in flight
    when the version moves (no interruption possible), and no episode spans a version change."""
    heads, running, crossed, stats = run(4, 0, 8, fifo=False)
    assert heads == [[s] for s in range(8)]
    assert running == [0] * 8 and crossed == 0
    assert stats["consumed_staleness_0"] == 32 and not any(k.startswith("consumed_staleness_1") for k in stats)


def test_stale_batches_config_is_validated():
    RolloutConfig(max_staleness=0, stale_batches=2).validate()
    assert RolloutConfig(max_staleness=0, stale_batches=2).staleness_budget == 2
    with pytest.raises(ConfigError, match=r"rollout.stale_batches=2 .*needs rollout.max_staleness=0 \(got 4\)"):
        RolloutConfig(max_staleness=4, stale_batches=2).validate()
    with pytest.raises(ConfigError, match="rollout.stale_batches=-1 must be >= 0"):
        RolloutConfig(max_staleness=0, stale_batches=-1).validate()
