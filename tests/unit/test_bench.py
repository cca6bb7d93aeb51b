"""`mega-async bench`: scenario validation, the noise-aware regression gate, history and the CLI's exit codes."""
import copy
import json
from pathlib import Path

import pytest

from mega_async.bench import gate as bench_gate, scenarios as bench
from mega_async.cli import main as cli

ROOT = Path(__file__).resolve().parents[2]
RULE_HI = {"better": "higher", "threshold": 0.2, "max_tolerance": 0.5}
RULE_LO = {"better": "lower", "threshold": 0.2}


def result(values: dict, rules: dict, name: str = "s") -> dict:
    figs = {k: bench_gate.stat(v) for k, v in values.items()}
    return {"schema": 1, "created": "2026-12-01T00:00:00Z", "machine": {"cpus": 2, "gpu": None, "load_avg": [1, 1, 1]},
            "git": {"commit": "abc", "dirty": False}, "scenarios": {name: {"figures": figs, "rules": rules}}}


def verdicts(cur, base):
    return {v["figure"]: v for v in bench_gate.compare(cur, base)}


def test_stat_median_and_relative_spread():
    s = bench_gate.stat([10.0, 12.0, None, 8.0])
    assert s["median"] == 10.0 and s["spread"] == pytest.approx(0.2) and s["missing"] == 1
    assert bench_gate.stat([None])["median"] is None


def test_gate_flags_regressions_beyond_threshold_only():
    rules = {"tps": RULE_HI, "lat": RULE_LO}
    base = result({"tps": [100, 100, 100], "lat": [1.0, 1.0, 1.0]}, rules)
    assert verdicts(result({"tps": [85, 85, 85], "lat": [1.15] * 3}, rules), base)["tps"]["verdict"] == "ok"
    v = verdicts(result({"tps": [70, 70, 70], "lat": [1.3] * 3}, rules), base)
    assert v["tps"]["verdict"] == "REGRESSED" and v["tps"]["change"] == pytest.approx(-0.3)
    assert v["lat"]["verdict"] == "REGRESSED"
    assert verdicts(result({"tps": [150] * 3, "lat": [0.5] * 3}, rules), base)["lat"]["verdict"] == "improved"


def test_gate_widens_with_noise_but_never_past_max_tolerance():
    rules = {"tps": RULE_HI}
    base = result({"tps": [100, 100, 100]}, rules)
    noisy = result({"tps": [50, 70, 90]}, rules)  # median 70 (-30%), spread 20/70 -> tolerance 2 x 0.286 = 0.57
    assert verdicts(noisy, base)["tps"]["tolerance"] == pytest.approx(0.5)  # capped at max_tolerance
    assert verdicts(noisy, base)["tps"]["verdict"] == "ok"
    assert verdicts(result({"tps": [30, 40, 50]}, rules), base)["tps"]["verdict"] == "REGRESSED"  # -60% > 50%


def test_lost_figure_regresses_and_new_scenario_passes():
    rules = {"tps": RULE_HI}
    base = result({"tps": [100]}, rules)
    assert verdicts(result({"tps": [None]}, rules), base)["tps"]["verdict"] == "REGRESSED"
    assert verdicts(result({"tps": [1]}, rules, name="other"), base)["tps"]["verdict"] == "new"
    assert verdicts(result({"tps": [1], "x": [2]}, rules), None)["x"]["verdict"] == "info"


def test_floor_makes_zero_baselines_comparable():
    rules = {"stale": {"better": "lower", "threshold": 0.5, "floor": 1.0}}
    base = result({"stale": [0.0]}, rules)
    assert verdicts(result({"stale": [0.3]}, rules), base)["stale"]["verdict"] == "ok"
    assert verdicts(result({"stale": [0.8]}, rules), base)["stale"]["verdict"] == "REGRESSED"


def test_shipped_scenarios_load_and_bad_ones_say_why(tmp_path):
    names = {s.name for s in bench.find_scenarios()}
    assert {"tiny_async", "tiny_sync", "executor"} <= names
    bad = tmp_path / "bad.yaml"
    for text, msg in (("name: x\nrepeat: 3\nexecutor: {}\n", "unknown key"), ("name: x\n", "needs a train"),
                      ("name: x\nexecutor: {}\nfigures: {a: {better: up, threshold: 1}}\n", "figures.a"),
                      ("name: x\nrepeats: 0\nexecutor: {}\n", "repeats"),
                      ("name: x\ntrain: {overrides: []}\n", "takes config")):
        bad.write_text(text)
        with pytest.raises(bench.BenchError, match=msg):
            bench.load_scenario(bad)
    with pytest.raises(bench.BenchError, match="no scenario 'nope'"):
        bench.find_scenarios(["nope"])


def test_recorded_result_against_a_better_baseline_fails(tmp_path, capsys):
    """The checked-in CPU baseline is a real recorded result: against a baseline three times as good on each gated
    figure the gate must fail (exit 1) and name the figures; against itself it passes."""
    recorded = ROOT / "benchmarks" / "baselines" / "cpu.json"
    data = bench_gate.load_json(recorded, "baseline")
    better = copy.deepcopy(data)
    n_gated = 0
    for scn in better["scenarios"].values():
        for fig, rule in scn["rules"].items():
            s = scn["figures"].get(fig)
            if s and s["median"]:
                s["median"] = s["median"] * 3 if rule["better"] == "higher" else s["median"] / 3
                n_gated += 1
    assert n_gated >= 5
    (tmp_path / "better.json").write_text(json.dumps(better))
    assert cli(["bench", "--result", str(recorded), "--baseline", str(tmp_path / "better.json")]) == 1
    err = capsys.readouterr().err
    assert "regressed" in err and "tiny_async/gen_groups_per_s" in err and "executor/executor_traj_per_s" in err
    assert cli(["bench", "--result", str(recorded), "--baseline", str(recorded)]) == 0


def test_bad_baseline_file_is_one_line_error(tmp_path, capsys):
    (tmp_path / "b.json").write_text("{not json")
    recorded = ROOT / "benchmarks" / "baselines" / "cpu.json"
    assert cli(["bench", "--result", str(recorded), "--baseline", str(tmp_path / "b.json")]) == 2
    assert "is not JSON" in capsys.readouterr().err


def test_real_executor_scenario_gate_and_history(tmp_path, capsys):
    """A real (small) executor measurement: a baseline 10x faster than reality fails the gate; the result
    carries machine, versions and commit; the history gets a line and a plot."""
    scn = tmp_path / "exec_small.yaml"
    scn.write_text("name: exec_small\nrepeats: 2\nexecutor: {trajectories: 512, batch: 32, eta: 1, rounds: 1}\nfigures:\n"
                   "  executor_traj_per_s: {better: higher, threshold: 0.3, max_tolerance: 0.5}\n")
    out, hist = tmp_path / "result.json", tmp_path / "hist"
    args = ["bench", str(scn), "--out", str(out), "--history-dir", str(hist)]
    assert cli(args + ["--update-baseline", "--baseline", str(tmp_path / "base.json")]) == 0
    res = json.loads(out.read_text())
    assert res["git"]["commit"] and res["versions"]["torch"] and res["machine"]["cpus"]
    figs = res["scenarios"]["exec_small"]["figures"]
    assert len(figs["executor_traj_per_s"]["values"]) == 2 and figs["executor_vs_direct_ratio"]["median"] > 0
    fake = json.loads(out.read_text())
    fake["scenarios"]["exec_small"]["figures"]["executor_traj_per_s"]["median"] *= 10
    (tmp_path / "fast.json").write_text(json.dumps(fake))
    capsys.readouterr()
    assert cli(args + ["--baseline", str(tmp_path / "fast.json")]) == 1
    assert "exec_small/executor_traj_per_s" in capsys.readouterr().err
    base = json.loads((tmp_path / "base.json").read_text())
    assert base["scenarios"]["exec_small"]["measured"]["git"] == res["git"]  # stamped where it was measured
    # a scenario from a file written before scenarios carried their stamp: the file's own is its stamp
    base["scenarios"]["other"] = {k: v for k, v in base["scenarios"]["exec_small"].items() if k != "measured"}
    base["created"] = "2020-01-01T00:00:00Z"
    (tmp_path / "base.json").write_text(json.dumps(base))
    assert cli(args + ["--update-baseline", "--baseline", str(tmp_path / "base.json"), "--no-history"]) == 0
    res2 = json.loads(out.read_text())
    merged = json.loads((tmp_path / "base.json").read_text())
    assert set(merged["scenarios"]) == {"exec_small", "other"}  # kept
    # each scenario says where it was measured: the kept one keeps the old file's stamp, not this run's
    assert merged["scenarios"]["other"]["measured"]["created"] == base["created"]
    assert merged["scenarios"]["exec_small"]["measured"]["created"] == merged["created"] == res2["created"]
    lines = (hist / "history.jsonl").read_text().splitlines()
    assert len(lines) == 2 and (hist / "history.png").read_bytes()[:4] == b"\x89PNG"
