"""tools/bench_async.py: variant parsing, per-variant medians/spreads, speed-ups against sync, table and plot."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_async", ROOT / "tools" / "bench_async.py")
bench_async = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_async)


def run(variant, eta, seed, wall, ttr, final, prox=None):
    return {"variant": variant, "eta": eta, "prox_logp": prox, "seed": seed, "wall_s": wall, "time_to_reward_s": ttr,
            "reward_final": final, "token_staleness_mean": 0.1 * eta, "staleness_mean": None,
            "gen_groups_per_s": 100 / wall, "curve": [(1.0, 0.1), (wall, final)]}


RUNS = [run("sync", 0, 1, 100, 60, 1.0), run("sync", 0, 2, 120, 80, 0.9), run("sync", 0, 3, 110, None, 0.95),
        run("eta4", 4, 1, 50, 30, 0.96), run("eta4", 4, 2, 40, 20, 0.92), run("eta4", 4, 3, 60, 40, 0.9),
        run("eta4-ppo", 4, 1, 55, None, 0.5, "behavior")]


def test_parse_variants():
    assert bench_async.parse_variants("sync:0,eta4-ppo:4:behavior") == [
        {"name": "sync", "eta": 0, "prox_logp": None}, {"name": "eta4-ppo", "eta": 4, "prox_logp": "behavior"}]
    with pytest.raises(SystemExit, match="bad variant"):
        bench_async.parse_variants("sync")
    with pytest.raises(SystemExit, match="repeat"):
        bench_async.parse_variants("a:1,a:2")


def test_aggregate_medians_spreads_and_speedups():
    rows = {r["variant"]: r for r in bench_async.aggregate(RUNS)}
    s, a, p = rows["sync"], rows["eta4"], rows["eta4-ppo"]
    assert s["wall_s"] == 110 and s["wall_s_spread"] == (100, 120) and s["speedup"] == 1.0
    assert a["wall_s"] == 50 and a["speedup"] == pytest.approx(110 / 50)
    assert s["time_to_reward_s"] == 70 and s["time_to_reward_s_missing"] == 1  # one seed never reached 0.8
    assert a["speedup_to_reward"] == pytest.approx(70 / 30)
    assert a["reward_gap_vs_sync"] == pytest.approx(0.92 - 0.95)
    assert p["time_to_reward_s"] is None and p["speedup_to_reward"] is None and p["prox_logp"] == "behavior"


def test_table_and_plot_from_recorded_results(tmp_path):
    saved = tmp_path / "runs.json"
    saved.write_text(json.dumps({"meta": {"steps": 2}, "runs": RUNS}))
    assert bench_async.main(["--from-results", str(saved), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "table.md").read_text()
    assert "| eta4 | 4 | config | 3 | 50 [40..60] | 2.20x |" in text
    assert "| eta4-ppo | 4 | behavior | 1 |" in text and "never" in text
    assert (tmp_path / "out" / "plot.png").read_bytes()[:4] == b"\x89PNG"
