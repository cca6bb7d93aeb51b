"""A server restarted after kill -9 under the distributed sync, when it is the only server: the trainer brings it to
the current version itself (distributed_sync.catch_up, run while rank 0 waits for the step's groups), and the
batch is generated at that version. Before, the run waited for groups no server could generate and stopped after
inference.unhealthy_timeout ("behind the synced weight version"). On the embedded server (default suite) and on
the real SGLang engine (tests/integration/test_sglang_cpu.py's kill test, the whole run): the gap was in the sync
and the client, not in either engine. The worker takes --engine sglang too (by hand: one more real server start and
restart, about 80 s, that CI does not spend)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("catch_up_worker.py")
CARD = ROOT / "models" / "tiny-qwen3-moe"


@pytest.mark.slow  # CI's second step: the default suite's budget
def test_a_restarted_only_server_is_caught_up_by_the_trainer(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(WORKER), "--model", str(CARD), "--engine", "embedded", "--out", str(out),
           "--logs", str(tmp_path / "logs")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-5000:]
    res = json.loads(out.read_text())
    assert res["v0"]["version"] == "0" and res["v1"]["version"] == "1" and res["v1"]["tokens"] != res["v0"]["tokens"]
    # the wait was interrupted, the server caught up once, and the batch came from version 1 only
    assert res["interrupted"] >= 1 and res["catch_ups"] >= 1
    assert res["batch_versions"] == [1]
    after = res["after_catch_up"]
    assert after["version"] == "1" and after["tokens"] == res["v1"]["tokens"]  # greedy: the same weights
    assert torch.allclose(torch.tensor(after["logprobs"]), torch.tensor(res["v1"]["logprobs"]), atol=1e-5)
    assert res["v2"]["version"] == "2"  # the next push builds the group again over it
    assert res["stats"]["failed"] == 0 and res["stats"]["rejected"] == 0
    lines = [json.loads(x) for x in (tmp_path / "logs" / "rollouts.jsonl").read_text().splitlines()]
    assert not [x for x in lines if x["verdict"] in ("failed", "rejected")], lines
