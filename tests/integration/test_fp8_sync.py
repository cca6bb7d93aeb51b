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
from mega_async.bridge.model_cards import TINY_DEEPSEEK, init_random_weights
from tests.commands import train_command

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


@pytest.mark.slow  # two conversions in subprocesses
def test_fp8_checkpoint_converts_to_mcore_and_back_dequantized(tmp_path):
    """hf-to-mcore reads an FP8 block checkpoint dequantized (its weight_scale_inv tensors are part of their
    weights, not tensors of their own); mcore-to-hf writes the dequantized weights without the
    quantization_config, so transformers loads it as the plain checkpoint it is."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from mega_async.bridge import HFTensors

    card = fp8.write_checkpoint(init_random_weights(TINY_DEEPSEEK, tmp_path / "bf16", seed=2), tmp_path / "fp8",
                                (16, 16))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for args in (["hf-to-mcore", "--hf", str(card), "--out", str(tmp_path / "mc")],
                 ["mcore-to-hf", "--mcore", str(tmp_path / "mc"), "--out", str(tmp_path / "back")]):
        r = subprocess.run([sys.executable, "-m", "mega_async.cli", "convert", *args], capture_output=True,
                           text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
    back, reader = load_file(str(tmp_path / "back" / "model.safetensors")), HFTensors(card)
    assert not any(k.endswith("_scale_inv") for k in back)
    assert all(torch.equal(t, reader.get(k).to(t.dtype)) for k, t in back.items())
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())
    AutoModelForCausalLM.from_pretrained(tmp_path / "back")


def _train(tmp_path, name, model, *overrides):
    cmd = train_command("tiny_deepseek_cpu", tmp_path / "runs", f"model.path={model}", f"experiment_name={name}",
                        "parallel.allocation=sglang:d1+megatron:d1", "trainer.total_steps=3", "rollout.max_staleness=0",
                        "trainer.sync_weight_format=fp8_block", *overrides)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-6000:]
    run = tmp_path / "runs" / name / "run0"
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()], run


@pytest.mark.slow  # two 3-step runs (steps 1 and 2 on FP8-synced weights)
def test_fp8_rollout_gap_and_its_correction(tmp_path):
    """`mega-async train` with an FP8 card and trainer.sync_weight_format=fp8_block (synchronous, so the FP8 gap is
    the only off-policyness): once the servers hold FP8-synced weights the trainer measures the gap
    (mismatch/logprob_abs_*); uncorrected (prox_logp=behavior) it shows up as a policy change before any update
    (approx_kl != 0), with the proximal logprobs recomputed and TIS the ratio starts at 1 (approx_kl and clip_frac
    0) and the gap is carried by the behaviour weight. final_hf is a plain checkpoint."""
    card = fp8.write_checkpoint(init_random_weights(TINY_DEEPSEEK, tmp_path / "bf16", seed=0), tmp_path / "fp8",
                                (128, 128))
    raw, _ = _train(tmp_path, "nocorr", card, "algorithm.prox_logp=behavior")
    tis, run = _train(tmp_path, "tis", card, "algorithm.prox_logp=recompute", "algorithm.imp_weight_mode=tis")
    for steps in (raw, tis):
        assert steps[0]["train/mismatch/logprob_abs_max"] < 1e-5  # version 0: both hold the dequantized card
        assert max(s["train/mismatch/logprob_abs_mean"] for s in steps[2:]) > 1e-3  # FP8-synced weights
        assert all(s["sync/verify_max_abs_diff"] == 0.0 for s in steps)  # checksums agreed (auto -> checksum)
    assert max(abs(s["train/approx_kl"]) for s in raw[2:]) > 1e-6
    assert all(s["train/approx_kl"] == 0.0 and s["train/clip_frac"] == 0.0 for s in tis)
    assert "quantization_config" not in json.loads((run / "final_hf" / "config.json").read_text())
