"""CPU smoke run of the GSM8K pipeline on the tiny model (`mega-async train -c configs/gsm8k_tiny_cpu.yaml`):
chat-template prompts, the math-verify reward and greedy pass@1 on held-out problems every step, written
as eval/* metrics. The tiny model does not solve GSM8K: this checks the pipeline, not learning."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from mega_async.bridge.model_cards import TINY_MOE, init_random_weights
from tests.commands import train_command

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gsm8k_pipeline_on_the_cpu(tmp_path):
    model = init_random_weights(TINY_MOE, tmp_path / "moe", seed=4)
    r = subprocess.run(train_command("gsm8k_tiny_cpu", tmp_path / "runs", f"model.path={model}", tensorboard=True),
                       capture_output=True, text=True, timeout=900, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-4000:]
    run = tmp_path / "runs" / "gsm8k_tiny_cpu" / "run0"
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1, 2]
    for s in steps:
        assert s["eval/problems"] == 4 and 0.0 <= s["eval/pass@1"] <= 1.0 and s["eval/reward_failures"] == 0
        assert s["eval/output_tokens_mean"] > 0 and 0.0 <= s["reward_mean"] <= 1.0 and s["train/tokens"] > 0
    log = (run / "train.log").read_text()
    assert "held out the last 4 of 20 rows" in log and "greedy pass@1 over 4 held-out problems" in log
