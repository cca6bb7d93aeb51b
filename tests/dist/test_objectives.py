"""The off-policy objectives inside the train engine: packed micro-batches give the loss of the unpacked rows
(sequence-level GSPO ratios and sequence masks see whole sequences), and the objective changes the update."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mega_async.comm import free_port
from mega_async.model_cards import TINY_MOE, init_random_weights

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
pytestmark = pytest.mark.slow  # three single-rank Megatron runs


def run(model: Path, out: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={free_port()}",
           str(HERE / "objective_worker.py"), "--model", str(model), "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-6000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return init_random_weights(TINY_MOE, tmp_path_factory.mktemp("obj") / "moe", seed=0)


def test_objectives_in_the_engine(moe, tmp_path):
    gspo = run(moe, tmp_path / "gspo", "--objective", "gspo", "--prox", "behavior")
    assert gspo["loss"] == pytest.approx(gspo["expected"], rel=1e-4, abs=1e-6)
    seq = run(moe, tmp_path / "seq", "--mode", "seq_mask")
    assert seq["loss"] == pytest.approx(seq["expected"], rel=1e-4, abs=1e-6)
    assert 0 < seq["masked"] < 1 and seq["engine_masked"] == pytest.approx(seq["masked"], abs=1e-6)
    token = run(moe, tmp_path / "token", "--prox", "behavior")
    assert token["loss"] == pytest.approx(token["expected"], rel=1e-4, abs=1e-6)
    assert max(abs(gspo["weights"][k] - token["weights"][k]) for k in token["weights"]) > 1e-4
