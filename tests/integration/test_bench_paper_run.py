"""tools/bench_paper.py end to end on a 2-step config: a short `mega-async sft`, then the sweep's runner for a
pinned asynchronous run and an unpinned synchronous one, each scored on the held-out split, their weight exports
too (--snapshots); the outputs are written from the recorded results and a second call resumes (runs nothing)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_paper", ROOT / "tools" / "bench_paper.py")
bp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bp)
pytestmark = pytest.mark.slow  # an SFT run and two training runs


def test_sweep_runner_on_a_two_step_config(tmp_path):
    sft = tmp_path / "sft" / "addition_sft" / "run0"
    r = subprocess.run([sys.executable, "-m", "mega_async.cli", "sft", "-c", "configs/addition_sft_cpu.yaml",
                        f"logging.root_dir={tmp_path / 'sft'}", "trainer.total_steps=3", "trainer.warmup_steps=1",
                        "trainer.stop_at_accuracy=null", "trainer.eval_interval=0", "task.eval_size=16",
                        "task.rl_prompts=64"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((sft / "sft_eval.json").read_text())["problems"] == 16
    out = tmp_path / "paper"
    argv = ["--variants", "eta2-dec,sync-unpinned", "--seeds", "1", "--steps", "2", "--sft-dir", str(sft),
            "--out", str(out), "--runs-dir", str(tmp_path / "runs"), "--snapshots", "1", "rollout.consumer_batch_size=2",
            "rollout.group_size=2", "trainer.ppo_n_minibatches=1"]
    assert bp.main(argv) == 0
    runs = {p.stem: json.loads(p.read_text()) for p in (out / "raw").glob("*.json")}
    assert set(runs) == {"eta2-dec_s1", "sync-unpinned_s1"}
    a = runs["eta2-dec_s1"]
    assert a["pin"] and a["eta"] == 2 and len(a["curve"]) == 2 and a["wall_s"] > 0
    assert 0.0 <= a["final_eval"]["greedy"] <= 1.0 and a["final_eval"]["problems"] == 16
    # the exports after steps 0 and 1, at those steps' times; the last is the final weights, scored alike
    assert [h[:2] for h in a["heldout_curve"]] == [c[:2] for c in a["curve"]]
    assert a["heldout_curve"][-1][2] == a["final_eval"]["greedy"]
    assert sorted(p.name for p in (tmp_path / "runs" / "bench_paper" / "eta2-dec_s1" / "hf_snapshots").iterdir()) \
        == ["step_0", "step_1"]
    log = (tmp_path / "runs" / "bench_paper" / "eta2-dec_s1" / "train.log").read_text()
    assert "pinned server pid" in log  # the server ran on its own half of the CPUs
    assert not runs["sync-unpinned_s1"]["pin"]
    text = (out / "table2.md").read_text()
    assert "| eta2-dec | 2 | decoupled | abort | yes | 1 |" in text
    assert all((out / f"{f}.png").exists() for f in ("fig5a", "fig5b", "fig5c", "fig6b"))
    before = {p: p.stat().st_mtime for p in (out / "raw").glob("*.json")}
    assert bp.main(argv) == 0  # resumed: both results exist, nothing runs again
    assert {p: p.stat().st_mtime for p in (out / "raw").glob("*.json")} == before
    # each run records its machine, the sweep its start; the per-run bounds pair only a seed's sync run (none here)
    assert a["cpu"] == bp.cpu_identity() and "Runs by CPU: " + bp.cpu_identity() + ": 2." in text
    meta = json.loads((out / "meta.json").read_text())
    assert meta["sft_sha256"] == bp.sft_fingerprint(sft) and len(meta["sweeps"]) == 2
    assert "## Per run" in text
    meta["sft_sha256"] = "0" * 64  # a later sitting from another SFT model is refused before it runs anything
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SystemExit, match="is not the one the runs in"):
        bp.main(argv)
