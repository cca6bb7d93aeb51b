"""The executor stops (never spins) on errors retrying cannot fix and on long runs of failed episodes."""
import asyncio
import time

import pytest

from mega_async.inference.sim.simulated import SimulatedEngine
from mega_async.rollout.executor import RolloutError, WorkflowExecutor
from mega_async.rollout.workflow import RolloutWorkflow
from mega_async.api.types import FatalEngineError


class Failing(RolloutWorkflow):
    """Raises `exc` for items with fail=True; returns the item otherwise."""

    def __init__(self, exc_factory):
        self.exc_factory = exc_factory
        self.calls = 0

    async def arun_episode(self, engine, data):
        self.calls += 1
        await asyncio.sleep(0.001)
        if data.get("fail", True):
            raise self.exc_factory(data["id"])
        return {"id": data["id"]}


def items(n, **kw):
    return [{"id": i, **kw} for i in range(n)]


def test_consecutive_failures_stop_with_the_first_error():
    wf = Failing(lambda i: ValueError(f"broken item {i}"))
    ex = WorkflowExecutor(SimulatedEngine(), wf, consumer_batch_size=2, max_staleness=1, max_consecutive_failures=5)
    t0 = time.monotonic()
    with ex:
        with pytest.raises(RolloutError, match=r"5 episodes failed in a row .*max_consecutive_failures=5.*"
                                               r"first error: ValueError: broken item 0"):
            ex.prepare_batch(items(1000))
    assert time.monotonic() - t0 < 5
    assert wf.calls < 20  # it stopped instead of drawing the whole dataset
    assert ex.stats["failed"] >= 5


def test_fatal_error_stops_at_once_and_stays_stopped():
    wf = Failing(lambda i: FatalEngineError(f"401 for item {i}"))
    ex = WorkflowExecutor(SimulatedEngine(), wf, consumer_batch_size=2, max_staleness=1, max_consecutive_failures=None)
    with ex:
        with pytest.raises(RolloutError, match="rollout stopped: FatalEngineError: 401 for item"):
            ex.prepare_batch(items(1000))
        ex.resume()  # a weight sync resumes the executor: a stopped rollout must stay stopped
        assert ex.paused
        with pytest.raises(RolloutError):
            ex.submit({"id": -1})
        with pytest.raises(RolloutError):
            ex.wait(1, timeout=1)
    assert wf.calls <= 4  # at most what was admitted before the first failure came back


def test_success_resets_the_failure_count():
    class Alternating(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            await asyncio.sleep(0.001)
            if data["id"] % 3:
                raise ValueError("flaky")
            return {"id": data["id"]}

    ex = WorkflowExecutor(SimulatedEngine(), Alternating(), consumer_batch_size=2, max_staleness=0,
                          max_concurrent_rollouts=1, max_consecutive_failures=3)
    with ex:
        for _ in range(3):
            out = ex.prepare_batch(items(300))
            ex.set_version(ex.version + 1)
            assert len(out) == 2
    assert ex.stats["failed"] >= 4


def test_null_limit_keeps_going_on_non_fatal_errors():
    wf = Failing(lambda i: ValueError("x"))
    data = items(40) + [{"id": 1000 + i, "fail": False} for i in range(2)]
    ex = WorkflowExecutor(SimulatedEngine(), wf, consumer_batch_size=2, max_staleness=0,
                          max_consecutive_failures=None)
    with ex:
        out = ex.prepare_batch(data)
    assert sorted(r["id"] for r in out) == [1000, 1001]


def test_token_versions_follow_weight_version_spans():
    from mega_async.inference.client import token_versions

    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions(spans, 5, 4) == [3, 3, 4, 4, 4]
    assert token_versions(None, 3, 7) == [7, 7, 7]
    assert token_versions([{"version": "x"}], 2, 1) == [1, 1]


def test_a_reward_that_cannot_run_here_stops_the_rollout_never_spins():
    """Issue 32: a code sandbox that cannot start rejected every sample and a run waited for a batch forever.
    A reward raising RewardUnavailable (SandboxUnavailable is one) stops the rollout at once, with its line;
    a reward that fails on every sample stops it after RewardRunner.max_failures_in_row."""
    from mega_async.reward.code import SandboxUnavailable
    from mega_async.rollout.workflow import RLVRWorkflow

    def no_sandbox(prompt, completion, **_):
        raise SandboxUnavailable("code sandbox: cannot create namespaces (...)")

    ex = WorkflowExecutor(SimulatedEngine(), RLVRWorkflow(no_sandbox), consumer_batch_size=2, max_staleness=1,
                          max_consecutive_failures=None)
    with ex:
        with pytest.raises(RolloutError, match="rollout stopped: SandboxUnavailable: code sandbox: cannot create"):
            ex.prepare_batch([{"input_ids": [1, 2], "id": i} for i in range(10_000)])
    calls = []

    def broken(prompt, completion, **_):
        calls.append(1)
        raise KeyError("answer")

    wf = RLVRWorkflow(broken)
    wf.reward.max_failures_in_row = 8
    ex = WorkflowExecutor(SimulatedEngine(), wf, consumer_batch_size=2, max_staleness=1, max_consecutive_failures=None)
    with ex:
        with pytest.raises(RolloutError, match=r"reward broken failed on 8 samples in a row \(last: raised KeyError"):
            ex.prepare_batch([{"input_ids": [1, 2], "id": i} for i in range(10_000)])
    assert len(calls) < 100
