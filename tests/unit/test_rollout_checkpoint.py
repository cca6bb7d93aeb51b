"""Rollout state through a checkpoint: the seeded epoch order, the ledger, and the executor's snapshot and
restore, where a rollout in flight continues from its last token instead of being regenerated."""
import asyncio
import json
import threading

import torch

from mega_async.rollout.dataloader import EpochLoader
from mega_async.rollout.executor import WorkflowExecutor
from mega_async.rollout.journal import EpisodeJournal, JournaledEngine
from mega_async.rollout.ledger import Ledger, read_ledger
from mega_async.rollout.workflow import GroupWorkflow, RLVRWorkflow
from mega_async.api.types import ModelRequest, ModelResponse, WeightVersion


class StreamingEngine:
    """Emits one token every `dt` seconds into the response it is given (as the SGLang client does across
    interruptions); token i of a request is 100 + i, tagged with the version at the time."""

    def __init__(self, version, dt=0.002):
        self.version, self.dt = version, dt
        self.running = threading.Event()
        self.running.set()
        self.calls = 0

    async def agenerate(self, req, resume=None):
        self.calls += 1
        resp = resume if resume is not None else ModelResponse(input_tokens=list(req.input_ids))
        while len(resp.output_tokens) < req.max_new_tokens:
            while not self.running.is_set():
                await asyncio.sleep(0.001)
            await asyncio.sleep(self.dt)
            resp.output_tokens.append(100 + len(resp.output_tokens))
            resp.output_logprobs.append(-1.0)
            resp.output_versions.append(self.version.value)
        resp.stop_reason = "length"
        return resp


def test_epoch_loader_order_is_seeded_and_resumable():
    items = list(range(10))
    a = EpochLoader(items, seed=3)
    first = [next(a) for _ in range(14)]
    assert sorted(s.data for s in first[:10]) == items and [s.epoch for s in first] == [0] * 10 + [1] * 4
    assert [s.data for s in first[:10]] != items  # shuffled
    b = EpochLoader(items, seed=3)
    b.load_state_dict(a.state_dict())
    assert [next(b).index for _ in range(8)] == [next(a).index for _ in range(8)]
    assert [s.index for s in first[:10]] != [s.index for s in first[10:14]] + [0] * 6


def test_journal_returns_finished_calls_and_continues_partial_ones():
    v = WeightVersion(3)
    eng = StreamingEngine(v)
    req = ModelRequest(input_ids=[1, 2], max_new_tokens=6)
    partial = ModelResponse(input_tokens=[1, 2], output_tokens=[100, 101], output_logprobs=[-0.5, -0.5],
                            output_versions=[1, 1])
    from mega_async.rollout.journal import CallRecord

    done = CallRecord([1, 2], 6, ModelResponse([1, 2], [7] * 6, [-2.0] * 6, [0] * 6, "stop"), done=True)
    j = EpisodeJournal([done, CallRecord([1, 2], 6, partial)])
    je = JournaledEngine(eng, j)

    async def main():
        return await je.agenerate(req), await je.agenerate(req), await je.agenerate(req)

    r1, r2, r3 = asyncio.run(main())
    assert r1.output_tokens == [7] * 6 and r1.stop_reason == "stop"  # no server call
    assert r2.output_tokens == [100, 101, 102, 103, 104, 105] and r2.output_versions == [1, 1, 3, 3, 3, 3]
    assert r3.output_versions == [3] * 6  # a new call
    assert eng.calls == 2


def test_snapshot_restore_keeps_every_rollout_and_its_tokens(tmp_path):
    version = WeightVersion()
    eng = StreamingEngine(version)
    wf = GroupWorkflow(RLVRWorkflow(lambda p, c, **kw: float(len(c) % 2), max_new_tokens=40), 2)
    loader = EpochLoader([{"input_ids": [1 + i, 2]} for i in range(50)], seed=0)
    ledger = Ledger(tmp_path / "rollouts.jsonl")
    ex = WorkflowExecutor(eng, wf, consumer_batch_size=2, max_staleness=1, version=version, ledger=ledger)
    with ex:
        assert len(ex.prepare_batch(loader)) == 2
        version.set(1)
        ex.wake()
        asyncio.run(asyncio.sleep(0.03))  # let the next episodes get part-way
        ex.pause()
        eng.running.clear()  # the servers pause
        state = ex.snapshot()
        ledger_size = ledger.size()
        loader_state = loader.state_dict()
    running = [e for e in state["episodes"] if e["state"] == "running"]
    assert running and all(e["head"] is not None for e in running)
    partial = {e["tag"]["index"]: e["journal"] for e in running}
    assert any(0 < len(r["output_tokens"]) < 40 for recs in partial.values() for r in recs)
    drawn = loader_state["position"]
    assert len(state["episodes"]) + 2 == drawn  # everything drawn is consumed or in the snapshot

    # resume in a fresh executor: the saved state, nothing else
    state = torch.load(_roundtrip(state, tmp_path), weights_only=True)
    Ledger.truncate(tmp_path / "rollouts.jsonl", ledger_size)
    version2 = WeightVersion()
    version2.set(1)
    eng2 = StreamingEngine(version2)
    loader2 = EpochLoader([{"input_ids": [1 + i, 2]} for i in range(50)], seed=0)
    loader2.load_state_dict(loader_state)
    ex2 = WorkflowExecutor(eng2, wf, consumer_batch_size=2, max_staleness=1, version=version2,
                           ledger=Ledger(tmp_path / "rollouts.jsonl"))
    with ex2:
        ex2.on_version_recovered(1)
        ex2.restore(state)
        batches = [ex2.prepare_batch(loader2)]
        version2.set(2)
        ex2.wake()
        batches.append(ex2.prepare_batch(loader2))
    lines = read_ledger(tmp_path / "rollouts.jsonl")
    consumed = [(ln["epoch"], ln["index"]) for ln in lines if ln["verdict"] == "accepted"]
    assert len(consumed) == len(set(consumed)) == 6 and [ln["step"] for ln in lines if ln["verdict"] == "accepted"][:2] == [0, 0]
    # a rollout that was part-way at the checkpoint kept its old tokens (version 0) and continued
    by_prompt = {int(g["input_ids"][0, 0]) - 1: g for b in batches for g in b}
    kept = [i for i, recs in partial.items() if i in by_prompt and any(r["output_tokens"] for r in recs)]
    assert kept
    for i in kept:
        g = by_prompt[i]
        for j, rec in enumerate(partial[i]):
            n = len(rec["output_tokens"])
            out = g["loss_mask"][j].bool()
            assert g["input_ids"][j][out][:n].tolist() == rec["output_tokens"]
            assert g["versions"][j][out][:n].tolist() == rec["output_versions"]  # old versions kept
            assert (g["versions"][j][out][n:] >= 1).all() and int(out.sum()) == 40
    json.dumps(lines)


def _roundtrip(state, tmp_path):
    path = tmp_path / "rollout.pt"
    torch.save(state, path)
    return path


def test_dynamic_filter_counters_and_drop_run_survive_a_checkpoint(tmp_path):
    """The filter's kept/dropped/forced counters and its drops-in-a-row run are in the executor's snapshot: a
    resume continues them (a run of equal-reward groups cut by a crash still forces a group through on time)."""
    from mega_async.rollout.filters import DynamicFilter

    version = WeightVersion()
    wf = GroupWorkflow(RLVRWorkflow(lambda p, c, **kw: 1.0, max_new_tokens=3), 2)  # every group all-equal
    flt = DynamicFilter(max_consecutive_drops=5)
    loader = EpochLoader([{"input_ids": [1 + i, 2]} for i in range(50)], seed=0)
    ex = WorkflowExecutor(StreamingEngine(version, dt=0), wf, consumer_batch_size=1, max_staleness=0,
                          version=version, should_accept=flt)
    with ex:
        ex.prepare_batch(loader)  # 5 drops, then one forced through
        ex.pause()
        state = torch.load(_roundtrip(ex.snapshot(), tmp_path), weights_only=True)
    before = flt.state_dict()
    assert before["forced"] == 1 and before["dropped"] >= 5 and state["accept"] == before
    flt2 = DynamicFilter(max_consecutive_drops=5)
    ex2 = WorkflowExecutor(StreamingEngine(WeightVersion(), dt=0), wf, consumer_batch_size=1, max_staleness=0,
                           should_accept=flt2)
    ex2.restore({**state, "episodes": []})
    assert flt2.state_dict() == before and flt2.stats["drop_rate"] == flt.stats["drop_rate"]


def test_reset_run_dir_cuts_metrics_ledger_and_timeline_back_to_the_checkpoint(tmp_path):
    from mega_async.checkpoint.format import reset_run_dir

    ck = tmp_path / "checkpoints" / "step_00000003"
    ck.mkdir(parents=True)
    for name in ("metrics.jsonl", "rollouts.jsonl", "events.jsonl"):
        (tmp_path / name).write_text('{"a": 1}\n{"b": 2}\n')
    (ck / "trainer.json").write_text(json.dumps({"metrics_bytes": 9, "ledger_bytes": 0, "events_bytes": 9,
                                                 "version": 4}))
    (tmp_path / "checkpoints" / "step_00000004.partial").mkdir()
    reset_run_dir(tmp_path, ck)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"a": 1}\n' == (tmp_path / "events.jsonl").read_text()
    assert (tmp_path / "rollouts.jsonl").read_text() == ""
    assert not (tmp_path / "checkpoints" / "step_00000004.partial").exists()
    reset_run_dir(tmp_path, None)  # a fresh start: the timeline of a run that never checkpointed goes too
    assert (tmp_path / "events.jsonl").read_text() == ""


def test_checkpoints_follow_the_wall_clock_cadence(monkeypatch):
    """trainer.save_every_minutes: a checkpoint after the first step that ends that long after the start or the last
    one (rank 0's clock), beside save_interval and the last step; 0 leaves the cadence to steps alone."""
    from mega_async.api.config_load import load_config
    from mega_async.run import checkpointer as ck

    now = [1000.0]
    monkeypatch.setattr(ck.time, "monotonic", lambda: now[0])
    cfg = load_config("configs/tiny_cpu.yaml", ["trainer.total_steps=100", "trainer.save_every_minutes=30"])
    c = ck.Checkpointer(cfg)
    saved = []
    monkeypatch.setattr(c, "_save", lambda step: saved.append(step) or f"step_{step}")
    for step, minutes in ((0, 10), (1, 29), (2, 31), (3, 45), (4, 62), (5, 90)):
        now[0] = 1000.0 + 60 * minutes
        assert c.after_step(step) is False
    assert saved == [2, 4]  # 31 min after the start; 62 is 31 after that one; 90 only 28 after 62
    off = ck.Checkpointer(load_config("configs/tiny_cpu.yaml", ["trainer.total_steps=100"]))
    monkeypatch.setattr(off, "_save", lambda step: saved.append(step))
    now[0] += 10 ** 6
    off.after_step(7)
    assert saved == [2, 4]


def test_a_preemption_never_starts_a_checkpoint_it_cannot_finish_before_the_deadline(monkeypatch, caplog):
    """On the pre-emption signal the run checkpoints at the step boundary, unless this run's last checkpoint took
    longer than what is left of launch.preempt_signal_s since the signal: then it starts none and says so in one
    line (the last one stands; a write cut off by the job's end would be lost anyway)."""
    import logging

    from mega_async.api.config_load import load_config
    from mega_async.run import checkpointer as ck

    now = [5000.0]
    monkeypatch.setattr(ck.time, "monotonic", lambda: now[0])

    class Signal:
        requested, at = False, None

        def __call__(self):
            return self.requested

    sig = Signal()
    cfg = load_config("configs/tiny_cpu.yaml", ["trainer.total_steps=100", "trainer.save_interval=2",
                                                "launch.preempt_signal_s=300"])
    c = ck.Checkpointer(cfg, stop_requested=sig)
    saved = []

    def save(step):  # a checkpoint that takes 120 s
        now[0] += 120
        saved.append(step)
        return f"step_{step}"

    monkeypatch.setattr(c, "_save", save)
    assert c.after_step(1) is False and saved == [1]
    sig.requested, sig.at = True, now[0] - 100  # 200 s left: 1.1 x 120 + 5 fits
    assert c.after_step(2) is True and saved == [1, 2] and str(c.preempted).endswith("checkpoint step_2; continue "
                                                                                     "with --resume")
    sig.at = now[0] - 250  # 50 s left
    with caplog.at_level(logging.WARNING, logger="mega_async"):
        assert c.after_step(3) is True
    assert saved == [1, 2]
    line = [r.getMessage() for r in caplog.records if "pre-empted after step 3" in r.getMessage()]
    assert line and "no checkpoint started, as the last one took 120s and 50s remain" in line[0], line
    assert "\n" not in line[0] and str(c.preempted) == "preempted after step 3; checkpoint step_2; continue with --resume"
