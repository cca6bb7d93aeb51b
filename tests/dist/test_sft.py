"""The SFT loss inside the train engine: equal to transformers' cross-entropy (with and without label
smoothing) on the same batch, and the engine's update equal to a torch Adam step on the same gradient."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mega_async.comm import free_port
from mega_async.model_cards import init_random_weights

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
pytestmark = pytest.mark.slow  # two single-rank Megatron runs


@pytest.mark.parametrize("smoothing", [0.0, 0.25])
def test_sft_loss_and_step_in_the_engine(tmp_path, smoothing):
    model = init_random_weights(ROOT / "models" / "tiny-addition", tmp_path / "card", seed=3)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={free_port()}",
           str(HERE / "sft_worker.py"), "--model", str(model), "--out", str(tmp_path / "r.json"),
           "--label-smoothing", str(smoothing)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-6000:]
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["tokens"] == res["mask_tokens"] > 0  # the answer tokens and EOS, nothing else
    assert res["loss"] == pytest.approx(res["expected"], rel=1e-5)
    assert res["max_weight_diff"] < 1e-4  # the step is lr 1e-3 per weight: the same update
