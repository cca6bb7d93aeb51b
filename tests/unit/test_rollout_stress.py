"""Stress property test of the rollout core with a simulated engine.

Random latencies, random interruptions at every weight update, random rejections, failures
and dynamic filtering, over several eta values and more than 5,000 consumed trajectories.
"""
import random
import threading
import time

import torch

from mega_async.inference.sim.simulated import SimulatedEngine
from mega_async.rollout.executor import WorkflowExecutor
from mega_async.rollout.filters import DynamicFilter
from mega_async.rollout.staleness import StalenessManager
from mega_async.rollout.workflow import GroupWorkflow, RLVRWorkflow
from mega_async.api.types import WeightVersion

GROUP = 2


class CheckedStaleness(StalenessManager):
    """Records any admission that breaks the capacity rule (checked under the manager's lock)."""

    violations: list

    def _submit_locked(self):
        super()._submit_locked()
        s = self._stat
        bound = (self.max_staleness + self._version.value + 1) * self.consumer_batch_size
        if s.running > self.max_concurrent_rollouts or s.accepted + s.running > bound:
            self.violations.append((s.running, s.accepted, self._version.value))


def run_stress(eta: int, B: int, steps: int, seed: int) -> int:
    rng = random.Random(seed)
    version = WeightVersion()
    engine = SimulatedEngine(vocab_size=50, chunk_tokens=4, token_latency=(0.0, 2e-4), seed=seed,
                             version=version.view())
    outcomes: dict[int, str] = {}
    lock = threading.Lock()

    def reward(prompt, completion, output_tokens, id, **_):
        h = hash((seed, id, tuple(output_tokens))) % 100
        if h < 2:
            raise ValueError("reward crashed")  # rejects that sample only
        return float(h % 2)

    class Tracked(GroupWorkflow):
        async def arun_episode(self, eng, data):
            if data["fail"]:
                with lock:
                    outcomes[data["id"]] = "failed"
                raise RuntimeError("episode crashed")
            out = await super().arun_episode(eng, data)
            with lock:
                outcomes[data["id"]] = "returned" if out is not None else "rejected"
            if out is not None:
                out["item_id"] = torch.full((out["rewards"].shape[0],), data["id"])
            return out

    flt = DynamicFilter()
    filtered = []

    def should_accept(traj):
        keep = flt(traj)
        if not keep:
            filtered.append(int(traj["item_id"][0]))
        return keep

    wf = Tracked(RLVRWorkflow(reward, max_new_tokens=24, stop_token_ids=[0]), GROUP)
    ex = WorkflowExecutor(engine, wf, consumer_batch_size=B, max_staleness=eta,
                          max_concurrent_rollouts=rng.choice([B, 2 * B, 4 * B]), should_accept=should_accept,
                          version=version.view())
    ex.staleness.__class__ = CheckedStaleness
    ex.staleness.violations = []
    submitted = []

    def loader():
        i = 0
        while True:
            submitted.append(i)
            yield {"id": i, "input_ids": [1, 2, 3], "fail": rng.random() < 0.03}
            i += 1

    data = loader()
    consumed = []
    n_traj = 0
    with ex:
        for step in range(steps):
            batch = ex.prepare_batch(data)
            assert len(batch) == B
            for g in batch:
                out_versions = g["versions"][g["loss_mask"].bool()]
                head = int(g["versions"].masked_fill(~g["loss_mask"].bool(), 10**9).min())
                assert step - head <= eta, f"head version {head} consumed at step {step}, eta={eta}"
                assert int(out_versions.max()) <= step
                consumed.append(int(g["item_id"][0]))
                n_traj += g["input_ids"].shape[0]
            # weight update: pause -> interrupt generation -> new version -> resume
            ex.pause()
            engine.pause_generation()
            before = ex.stats["submitted"]
            time.sleep(rng.uniform(0, 0.004))
            assert ex.stats["submitted"] == before, "an episode started while paused"
            version.set(step + 1)  # the one version both read (this test is the sync)
            ex.wake()
            engine.continue_generation()
            ex.resume()
        # drain: stop admitting, let running finish, take what is left
        ex.pause()
        deadline = time.time() + 30
        while ex.stats["running"] and time.time() < deadline:
            time.sleep(0.01)
        left = ex.stats["ready"]
        drained = [int(g["item_id"][0]) for g in ex.wait(left, timeout=10)] if left else []
        pending = ex.stats["enqueued"]
    assert not ex.staleness.violations, ex.staleness.violations[:5]
    assert len(consumed) == len(set(consumed)), "a trajectory was consumed twice"
    gone = {i for i, o in outcomes.items() if o in ("failed", "rejected")}
    assert not gone & set(consumed)
    accounted = set(consumed) | set(drained) | set(filtered) | gone
    assert len(consumed) + len(drained) + len(filtered) + len(gone) == len(accounted)
    assert accounted | set(submitted[len(submitted) - pending:]) == set(submitted), "a trajectory was lost"
    s = ex.stats
    assert s["filtered"] == len(filtered) and s["consumed"] == len(consumed) + len(drained)
    assert eta == 0 or engine.interruptions > 0  # eta=0 is synchronous: nothing in flight at updates
    return n_traj


def test_staleness_executor_stress():
    total = 0
    for eta, B, steps in [(0, 8, 60), (1, 8, 80), (2, 12, 60), (4, 16, 50)]:
        total += run_stress(eta, B, steps, seed=eta)
    assert total >= 5000, total
