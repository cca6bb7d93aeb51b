"""The pause fan-out runs with the rollout loop asleep (its aborted answers are read after it), and the loop
always wakes: when the pause call returns, when it fails, and at the latest after the limit."""
import threading

import pytest

from mega_async.inference.sim.simulated import SimulatedEngine
from mega_async.rollout.executor import WorkflowExecutor
from mega_async.rollout.runner import AsyncTaskRunner
from mega_async.trainer.sync import RolloutSide, SyncError, Transport, WeightSync
from mega_async.api.types import WeightVersion


class Engine(SimulatedEngine):
    """pause_generation asks the rollout loop to run a callback and records whether it ran meanwhile."""

    def __init__(self, *a, fail=False, **kw):
        super().__init__(*a, **kw)
        self.loop, self.fail, self.ran_during_pause, self.marker = None, fail, None, threading.Event()

    def pause_generation(self, mode="abort", timeout=None):
        self.loop.call_soon_threadsafe(self.marker.set)
        self.ran_during_pause = self.marker.wait(0.3)
        if self.fail:
            raise RuntimeError("server 0 unreachable")
        return super().pause_generation(mode, timeout)


class NoWeights(Transport):
    sends_new_weights = False

    def update(self, target):
        return None


@pytest.mark.parametrize("fail", [False, True], ids=["ok", "pause-fails"])
def test_the_rollout_loop_sleeps_during_the_pause_calls_and_wakes_after(fail):
    version = WeightVersion()
    engine = Engine(version=version, fail=fail)
    ex = WorkflowExecutor(engine, None, consumer_batch_size=1, max_staleness=1, version=version.view())
    with ex:
        engine.loop = ex._runner._loop
        sync = WeightSync([], version, RolloutSide(engine, ex), NoWeights(), timeout=10)
        try:
            if fail:
                with pytest.raises(SyncError, match="server 0 unreachable"):
                    sync.push()
            else:
                sync.push()
        finally:
            sync.close()
        assert engine.ran_during_pause is False  # parked
        assert engine.marker.wait(5)  # and awake again
        assert ex._runner.call(lambda: "alive", timeout=5) == "alive"
        assert version.value == (0 if fail else 1) and not ex.paused


def test_parked_wakes_after_its_limit():
    runner = AsyncTaskRunner()
    runner.start()
    try:
        ran = threading.Event()
        with runner.parked(0.2):
            runner._loop.call_soon_threadsafe(ran.set)
            assert ran.wait(2)  # the limit ended the sleep although the body is still running
        assert runner.call(lambda: "alive", timeout=5) == "alive"
    finally:
        runner.stop()
