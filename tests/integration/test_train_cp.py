"""`mega-async train` with context parallelism (`megatron:d1c2`): two trainer ranks split every sequence into
load-balanced chunks, the distributed weight sync (weights replicated over CP) is verified after every step,
and the final checkpoint is an ordinary HF one."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from test_train_driver import ROOT, leftovers, train_cmd  # noqa: E402

from mega_async.bridge.model_cards import TINY_MOE, init_random_weights  # noqa: E402


@pytest.mark.slow  # two ranks, three steps: about two minutes on 2 cores
def test_driver_trains_at_cp2(tmp_path):
    model = init_random_weights(TINY_MOE, tmp_path / "moe", seed=2)
    r = subprocess.run(train_cmd(model, tmp_path, "sglang:d1+megatron:d1c2"), capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-6000:]
    run = tmp_path / "runs" / "tiny_cpu" / "run0"
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["sync/verify_max_abs_diff"] < 1e-4 and s["train/tokens"] > 0
    final = load_file(str(run / "final_hf" / "model.safetensors"))
    src = load_file(str(model / "model.safetensors"))
    assert final.keys() == src.keys() and any(not final[k].equal(src[k]) for k in src)
    assert not leftovers(tmp_path)
