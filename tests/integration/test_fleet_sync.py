"""distributed_sync(data_plane="none") over a simulated fleet: the sync's control plane runs for real (the
benchmark seam of tools/bench_scale.py), no tensor moves, and it refuses servers that have a data plane."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mega_async.bridge.model_cards import TINY_MOE, init_random_weights

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("fleet_sync_worker.py")


@pytest.mark.slow
def test_control_plane_only_sync_over_the_fleet(tmp_path):
    model = init_random_weights(TINY_MOE, tmp_path / "moe", seed=5)
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(WORKER), "--model", str(model), "--servers", "16", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["version"] == 2 and res["sessions_open"] == []
    buckets = res["pushes"][0]["sync/buckets"]
    assert buckets > 5 and res["pushes"][0]["sync/bytes"] > 1e6
    for s in res["states"]:  # every server got every bucket's message, sessions closed, the version set, no group
        assert s["version"] == "2" and s["session"] is None and len(s["groups"]) == 1
        assert s["counters"]["buckets"] == 2 * buckets
    assert all(stop == "length" for stop in res["stops"]) and len(res["stops"]) == 32
    assert any(len(v) > 1 for v in res["versions"]), res["versions"]  # cut by a sync, resumed under the new one
    assert res["refused"] and "data_plane='none' needs simulated fleet servers" in res["refused"]
