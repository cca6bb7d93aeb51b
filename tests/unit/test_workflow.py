import asyncio
import time

import pytest
import torch

from mega_async.inference.sim.simulated import SimulatedEngine
from mega_async.reward import RewardRunner
from mega_async.rollout.workflow import GroupWorkflow, RLVRWorkflow
from mega_async.algo.batch import concat_padded
from mega_async.api.types import ModelRequest, ModelResponse


class FixedEngine:
    """Answers every request with the same tokens, logprobs and versions."""

    def __init__(self, tokens, versions):
        self.tokens, self.versions = tokens, versions

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        n = len(self.tokens)
        return ModelResponse(list(req.input_ids), list(self.tokens), [-0.5] * n, list(self.versions), "stop")


def run(coro):
    return asyncio.run(coro)


def test_rlvr_trajectory_tensors():
    seen = {}

    def reward(prompt, completion, answer, output_tokens, **_):
        seen.update(answer=answer, output_tokens=output_tokens)
        return 2.5

    wf = RLVRWorkflow(reward, max_new_tokens=8)
    t = run(wf.arun_episode(FixedEngine([7, 8, 9], [3, 3, 4]), {"input_ids": [1, 2], "answer": "42"}))
    assert t["input_ids"].tolist() == [[1, 2, 7, 8, 9]]
    assert t["loss_mask"].tolist() == [[0, 0, 1, 1, 1]]
    assert t["versions"].tolist() == [[-1, -1, 3, 3, 4]]
    assert t["logprobs"].tolist() == [[0.0, 0.0, -0.5, -0.5, -0.5]]
    assert t["attention_mask"].tolist() == [[1] * 5]
    assert t["rewards"].tolist() == [2.5]
    assert seen == {"answer": "42", "output_tokens": [7, 8, 9]}


def test_async_reward_and_rejections():
    async def areward(prompt, completion, **_):
        await asyncio.sleep(0)
        return 1

    eng = FixedEngine([5], [0])
    assert run(RLVRWorkflow(areward).arun_episode(eng, {"input_ids": [1]}))["rewards"].item() == 1.0

    def bad(prompt, completion, **_):
        raise ZeroDivisionError("x")

    assert run(RLVRWorkflow(bad).arun_episode(eng, {"input_ids": [1]})) is None
    assert run(RLVRWorkflow(lambda p, c, **_: float("nan")).arun_episode(eng, {"input_ids": [1]})) is None


def test_sync_reward_timeout_rejects_without_blocking_loop():
    def slow(prompt, completion, **_):
        time.sleep(1.0)
        return 1.0

    runner = RewardRunner(slow, timeout=0.1)

    async def main():
        t0 = time.monotonic()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while time.monotonic() - t0 < 0.15:
                ticks += 1
                await asyncio.sleep(0.01)

        res, _ = await asyncio.gather(runner("p", "c"), ticker())
        return res, ticks, time.monotonic() - t0

    res, ticks, dt = run(main())
    assert res is None and runner.failures == 1
    assert ticks >= 5  # the event loop kept running while the sync reward ran in a thread
    assert dt < 0.9


def test_group_workflow_concat_and_partial_rejection():
    calls = {"n": 0}

    def reward(prompt, completion, **_):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("one member fails")
        return float(len(completion))

    eng = SimulatedEngine(vocab_size=20, seed=3)
    wf = GroupWorkflow(RLVRWorkflow(reward, max_new_tokens=6), group_size=4)
    g = run(wf.arun_episode(eng, {"input_ids": [1, 2, 3]}))
    assert g["input_ids"].shape[0] == 3  # one member rejected, three kept
    assert g["rewards"].shape == (3,)
    lengths = g["attention_mask"].sum(1)
    assert torch.equal(g["loss_mask"].sum(1), lengths - 3)
    assert (g["versions"][g["attention_mask"] == 0] == -1).all()
    with pytest.raises(ValueError):
        GroupWorkflow(wf, 0)


def test_group_member_error_cancels_the_others_and_leaves_no_unretrieved_error():
    """A member's engine error (e.g. no live server) ends the group: the members still generating are cancelled
    and awaited, so no "Task exception was never retrieved" lands on stderr after the run's own error line."""
    cancelled = []

    class DeadAfterOne:
        def __init__(self):
            self.n = 0

        async def agenerate(self, req):
            self.n += 1
            me = self.n
            if me == 1:
                await asyncio.sleep(0)
                raise RuntimeError("no live server")
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(me)
                raise

    unretrieved = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx["message"]))
        wf = GroupWorkflow(RLVRWorkflow(lambda **_: 1.0, max_new_tokens=4), group_size=3)
        with pytest.raises(RuntimeError, match="no live server"):
            await wf.arun_episode(DeadAfterOne(), {"input_ids": [1, 2]})
        assert sorted(cancelled) == [2, 3]  # not left running
        import gc
        gc.collect()
        await asyncio.sleep(0)

    run(main())
    assert unretrieved == []


def test_prompt_encoding_needs_tokenizer():
    wf = RLVRWorkflow(lambda p, c, **_: 0.0)
    with pytest.raises(ValueError, match="no tokenizer"):
        run(wf.arun_episode(FixedEngine([1], [0]), {"prompt": "hi"}))


def test_concat_padded_checks_keys():
    a = {"input_ids": torch.ones(1, 2, dtype=torch.long), "rewards": torch.ones(1)}
    b = {"input_ids": torch.ones(1, 3, dtype=torch.long), "rewards": torch.zeros(1)}
    out = concat_padded([a, b])
    assert out["input_ids"].tolist() == [[1, 1, 0], [1, 1, 1]]
    with pytest.raises(ValueError, match="keys differ"):
        concat_padded([a, {"input_ids": b["input_ids"]}])
