"""End to end on the tiny CPU run: `mega-async bench` on a real (short) training scenario fails against a
baseline better than reality; `mega-async train` keeps its console quiet and writes the report; the
paper-table tool runs two variants and writes table and plot."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

pytestmark = pytest.mark.slow  # each starts a server and a Megatron rank (~1 min on 2 cores)


def cli(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "mega_async.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_bench_training_scenario_figures_and_gate(tmp_path):
    scn = tmp_path / "tiny3.yaml"
    scn.write_text("name: tiny3\nrepeats: 1\ntrain:\n  config: configs/tiny_cpu.yaml\n"
                   "  overrides: [trainer.total_steps=3, trainer.warmup_steps=0, trainer.verify_sync=false]\n"
                   "figures:\n  gen_groups_per_s: {better: higher, threshold: 0.3}\n"
                   "  train_tokens_per_s: {better: higher, threshold: 0.3}\n")
    out, base = tmp_path / "result.json", tmp_path / "base.json"
    r = cli("bench", str(scn), "--out", str(out), "--history-dir", str(tmp_path / "h"), "--update-baseline",
            "--baseline", str(base))
    assert r.returncode == 0, r.stderr[-3000:]
    figs = json.loads(out.read_text())["scenarios"]["tiny3"]["figures"]
    for f in ("gen_groups_per_s", "gen_tokens_per_s", "train_tokens_per_s", "sync_s", "sync_bytes_per_s",
              "peak_rss_mib", "split_rollout_wait", "staleness_mean"):
        assert figs[f]["median"] is not None, f
    assert figs["peak_rss_mib"]["median"] > 100  # trainer + server processes
    assert abs(sum(figs[f"split_{k}"]["median"] for k in ("rollout_wait", "train", "sync", "other")) - 1) < 1e-6
    assert json.loads(out.read_text())["scenarios"]["tiny3"]["staleness_hist"]
    better = json.loads(base.read_text())
    better["scenarios"]["tiny3"]["figures"]["gen_groups_per_s"]["median"] *= 3
    base.write_text(json.dumps(better))
    r = cli("bench", "--result", str(out), "--baseline", str(base))
    assert r.returncode == 1 and "tiny3/gen_groups_per_s" in r.stderr
    assert "REGRESSED" in r.stdout


def test_train_console_is_quiet_and_the_report_is_written(tmp_path):
    r = cli("train", "-c", "configs/tiny_cpu.yaml", "trainer.total_steps=3", "trainer.warmup_steps=0",
            f"logging.root_dir={tmp_path}", "logging.tensorboard=false")
    assert r.returncode == 0, r.stderr[-3000:]
    console = r.stdout + r.stderr
    assert "Params for bucket" not in console and "UserWarning" not in console
    assert "mega_async.run.loop: step 2:" in console
    run = tmp_path / "tiny_cpu" / "run0"
    log = (run / "train.log").read_text()
    assert "Params for bucket" in log and "UserWarning" in log and "step 2:" in log
    assert (run / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert "generation (groups/s)" in r.stdout and "step time split" in r.stdout
    assert json.loads((run / "summary.json").read_text())["steps"] == 3


def test_bench_async_two_variants(tmp_path):
    r = subprocess.run([sys.executable, "tools/bench_async.py", "--variants", "sync:0,eta2-ppo:2:behavior",
                        "--seeds", "1", "--steps", "3", "--out", str(tmp_path / "out"), "--runs-dir",
                        str(tmp_path / "runs"), "trainer.warmup_steps=0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    text = (tmp_path / "out" / "table.md").read_text()
    assert "| sync | 0 | config | 1 |" in text and "| eta2-ppo | 2 | behavior | 1 |" in text
    runs = json.loads((tmp_path / "out" / "runs.json").read_text())["runs"]
    assert [x["steps"] for x in runs] == [3, 3] and all(x["wall_s"] > 0 for x in runs)
    assert (tmp_path / "out" / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_scale_runs_the_controller_and_a_baseline_on_a_small_fleet(tmp_path):
    """tools/bench_scale.py end to end on 4 fleet servers, 64 in flight, one measured step, the same controller
    as its own baseline (git archive of HEAD): every figure is there and nothing was lost or mislabelled."""
    out = tmp_path / "scale.json"
    r = subprocess.run([sys.executable, "tools/bench_scale.py", "--servers", "4", "--inflight", "64", "--steps", "1",
                        "--warmup", "0", "--throughput", "400", "--max-new-tokens", "64", "--baseline", "HEAD",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {x["variant"] for x in rows} == {"current", "baseline"}
    for x in rows:
        assert x["consumed"] == 16 and x["lost"] == x["duplicates"] == x["bad_labels"] == x["too_stale"] == 0, x
        assert x["bracket_s"] > 0 and x["control_s"] > 0 and x["cpu_per_traj_ms"] > 0
        assert x["pause_fleet_cpu_s"] >= 0 and x["bracket_gc_s"] >= 0
        assert x["running_at_sync"] >= x["in_flight_at_sync"] >= 0


def test_bench_abort_pause_measures_every_variant_and_every_request_is_aborted(tmp_path):
    """tools/bench_abort_pause.py end to end on 4 fleet servers, 32 running requests, one round of each variant
    (HEAD as the baseline): every request was running at the pause and was answered by it."""
    out = tmp_path / "abort.json"
    r = subprocess.run([sys.executable, "tools/bench_abort_pause.py", "--servers", "4", "--inflight", "32",
                        "--fleet-procs", "1", "--run-s", "0.5", "--rounds", "1", "--baseline", "HEAD",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [x["variant"] for x in res["rows"]] == ["HEAD unparked", "current unparked", "current parked"]
    for x in res["rows"]:
        assert x["in_flight"] == x["aborted"] == 32 and x["pause_s"] > 0 and x["fleet_cpu_s"] >= 0, x
    assert res["summary"]["pause_s / current parked"]["current parked"] == 1.0
