"""FP8 block weights end to end (trainer.sync_weight_format=fp8_block): a tiny DeepSeek-V3 FP8 card (the tiny card
quantized in 16x16 blocks, so every weight spans several blocks with ragged edges) loads dequantized into the
Megatron trainer and the embedded server; after a training step the distributed sync (flattened buckets) and
the disk sync send e4m3 weights + weight_scale_inv under the checkpoint's names, and the server then serves
exactly the dequantized FP8 grid of the trainer's weights (a transformers forward of it), not the trainer's own.
The measured FP8 gap is printed."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mega_async.bridge import fp8
from mega_async.model_cards import TINY_DEEPSEEK, init_random_weights

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("fp8_sync_worker.py")


@pytest.mark.slow  # a trainer and a server process (about a minute)
def test_fp8_sync_distributed_and_disk(tmp_path):
    card = fp8.write_checkpoint(init_random_weights(TINY_DEEPSEEK, tmp_path / "bf16", seed=4), tmp_path / "fp8",
                                (16, 16))
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(WORKER), "--card", str(card), "--root", str(tmp_path), "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-5000:]
    res = json.loads(out.read_text())

    def lp(rows, key="logprobs"):
        return torch.tensor([x for row in rows for x in (row[key] if isinstance(row, dict) else row)])

    start = res["start"]
    assert torch.allclose(lp(start["served"]), lp(start["reference"]), atol=1e-4)  # loaded as the formula says
    for mode in ("distributed", "disk"):
        case = res[mode]
        served, reference, trainer = lp(case["served"]), lp(case["reference"]), lp(case["trainer"])
        assert torch.allclose(served, reference, atol=1e-4), mode  # the server holds the FP8 grid
        gap = (served - trainer).abs()
        assert gap.max() > 1e-3, mode  # ... not the trainer's own weights
        print(f"FP8 gap after the {mode} sync: mean {gap.mean():.2e}, max {gap.max():.2e} over {gap.numel()} tokens")
    assert res["disk"]["version"] == 2 and res["distributed"]["stats"]["sync/buckets"] > 1
    d = res["disk_dir"]
    assert d["config"]["quantization_config"]["weight_block_size"] == [16, 16]
    assert [n + "_scale_inv" for n in d["fp8"]] == d["scales"]
    assert {"model.layers.0.self_attn.kv_b_proj.weight", "model.layers.1.mlp.experts.0.gate_proj.weight",
            "model.layers.1.mlp.shared_experts.down_proj.weight", "model.layers.0.mlp.up_proj.weight"} <= set(d["fp8"])
    assert not any(n.endswith(("mlp.gate.weight", "layernorm.weight")) for n in d["fp8"])
