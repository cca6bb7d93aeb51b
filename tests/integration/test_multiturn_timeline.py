"""A two-rank multi-turn training run: feedback turns through the real driver, and its event timeline (episodes,
interruptions, sync phases, every rank's train steps) drawn by the end-of-run report."""
import collections
import json
import os
import subprocess
from pathlib import Path

import pytest

from mega_async.utils.events import read_events, spans
from mega_async.bridge.model_cards import TINY_MOE, init_random_weights
from tests.commands import train_command

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.slow  # a server, two trainer ranks, three steps


def test_two_rank_multi_turn_run_records_its_timeline(tmp_path):
    model = init_random_weights(TINY_MOE, tmp_path / "moe", seed=0)
    cmd = train_command("tiny_cpu", tmp_path / "runs", f"model.path={model}", "parallel.allocation=sglang:d1+megatron:d2e2",
                        "trainer.total_steps=3", "rollout.max_new_tokens=8", "rollout.workflow=multi_turn",
                        "rollout.max_turns=2", "rollout.consumer_batch_size=4", "trainer.sync_timeout=60")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-6000:]
    run = tmp_path / "runs" / "tiny_cpu" / "run0"
    assert [json.loads(x)["version"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    ev = read_events(run / "events.jsonl")
    kinds = collections.Counter(e["kind"] for e in ev)
    assert kinds["episode_admitted"] >= 12 and kinds["episode_finished"] >= 12
    steps = spans(ev, "train_step", ("rank", "step"))
    assert sorted((s["rank"], s["step"]) for s in steps) == [(r, s) for r in (0, 1) for s in range(3)]
    pushes = [s for s in spans(ev, "sync", ("phase", "rank")) if s["phase"] == "push"]
    assert len(pushes) == 6 and all(s["ok"] for s in pushes)  # every rank, every step
    phases = {s["phase"] for s in spans(ev, "sync", ("phase", "rank")) if s.get("rank") == 0}
    assert {"pause", "update", "continue"} <= phases
    assert (run / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
