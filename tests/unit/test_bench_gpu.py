"""tools/bench_gpu.py and tools/gpu_check.sh on CPU: the parameter/flop arithmetic against a real model's
count, the skip path without a GPU, and (slow) the --cpu-dry-run of every Python part."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "tools" / "bench_gpu.py")
bench_gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_gpu)


def test_param_count_matches_transformers_model():
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    c = dict(bench_gpu.TINY)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**c, tie_word_embeddings=False, mlp_only_layers=[]))
    total = sum(p.numel() for p in model.parameters())
    active, counted = bench_gpu.active_params(c)
    assert counted == total
    expert = 3 * c["hidden_size"] * c["moe_intermediate_size"]
    assert total - active == c["num_hidden_layers"] * (c["num_experts"] - c["num_experts_per_tok"]) * expert
    a1b, t1b = bench_gpu.active_params(bench_gpu.MOE_1B)
    assert 0.8e9 < a1b < 1.2e9 and t1b > 2 * a1b  # the GPU figure's model is ~1B active
    assert bench_gpu.flops_per_token(c, 128) > 6 * active
    del torch


def test_gpu_check_without_gpu_fails_every_part_with_a_reason(tmp_path):
    """A GPU check where no GPU is visible checked nothing: it fails (before: four SKIPs and PASS, exit 0), naming
    --cpu-dry-run for checking the script itself on a CPU machine."""
    r = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "GPU_CHECK_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 1, r.stderr
    out = r.stdout
    assert out.count("==== mega_async gpu_check") == 1 and "==== FAIL ====" in out
    for part in ("gpu-tests", "parity", "train-step", "server-gen"):
        assert f"{part}" in out and "no CUDA device" in out and "--cpu-dry-run" in out
    assert (tmp_path / "summary.txt").read_text() == out
    bad = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr


@pytest.mark.slow  # a Megatron train step, a real SGLang CPU server and an embedded one (~1-2 min on 2 cores)
def test_gpu_check_cpu_dry_run_runs_every_python_part(tmp_path):
    """server-gen runs the GPU serving scenario's code: real SGLang (its CPU engine here, $SGLANG_CPU_VENV, which
    CI's second step builds) started by the project's launcher, then the embedded server on the same requests."""
    env = {**os.environ, "GPU_CHECK_DIR": str(tmp_path), "PYTHON": sys.executable}  # this venv's, not PATH's
    r = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--cpu-dry-run"], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "train-step   ok" in r.stdout and '"tokens_per_s"' in r.stdout
    assert "server-gen   ok" in r.stdout and "==== PASS ====" in r.stdout
    gen = json.loads((tmp_path / "server-gen.log").read_text().strip().splitlines()[-1])
    assert gen["sglang_gen_tokens_per_s"] > 0 and gen["embedded_gen_tokens_per_s"] > 0
    assert gen["sglang_over_embedded"] == pytest.approx(
        gen["sglang_gen_tokens_per_s"] / gen["embedded_gen_tokens_per_s"], rel=0.01)
    assert "-m sglang.launch_server" in gen["server_line"] and "--device cpu" in gen["server_line"]
