"""tools/convert_checkpoint.py both ways, single process and under torchrun; round trips are bit-identical."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mega_async.comm import free_port
from mega_async.model_cards import TINY_DEEPSEEK, TINY_DENSE, TINY_GLM, TINY_MOE, init_random_weights

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "convert_checkpoint.py"


def convert(*args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    pre = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}"]
    cmd = (pre if nproc > 1 else [sys.executable]) + [str(TOOL), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in x)


@pytest.mark.parametrize("card, save_layout, save_np, load_layout, load_np", [
    (TINY_MOE, "megatron:t2", 2, None, 1),  # TP2 checkpoint, read back on one rank
    (TINY_MOE, "megatron:d1", 1, "megatron:d2e2", 2),  # one-rank checkpoint, exported from EP2
    (TINY_DENSE, "megatron:p2", 2, "megatron:t2", 2),  # PP2 checkpoint resharded to TP2
], ids=["moe-tp2-to-1", "moe-1-to-ep2", "dense-pp2-to-tp2"])
def test_round_trip_is_bit_identical(tmp_path, card, save_layout, save_np, load_layout, load_np):
    hf = init_random_weights(card, tmp_path / "hf", seed=3)
    r = convert("hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mcore"), "--allocation", save_layout,
                nproc=save_np)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "converted hf-to-mcore:" in r.stdout and "tensors" in r.stdout
    meta = json.loads((tmp_path / "mcore" / "mega_async_meta.json").read_text())
    assert meta["allocation"] == save_layout
    args = ["mcore-to-hf", "--mcore", str(tmp_path / "mcore"), "--out", str(tmp_path / "back")]
    r = convert(*args, *(["--allocation", load_layout] if load_layout else []), nproc=load_np)
    assert r.returncode == 0, r.stderr[-4000:]
    assert same_weights(hf, tmp_path / "back")
    assert (tmp_path / "back" / "tokenizer.json").exists() and (tmp_path / "back" / "config.json").exists()
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.slow  # four torchrun launches
@pytest.mark.parametrize("card, save_layout, save_np, load_layout, load_np", [
    (TINY_DEEPSEEK, "megatron:t2", 2, None, 1),  # MLA shards and the router bias at TP2, read back on one rank
    (TINY_GLM, "megatron:d1", 1, "megatron:d2e2", 2),  # exported from EP2
], ids=["deepseek-tp2-to-1", "glm-1-to-ep2"])
def test_family_round_trip_is_bit_identical_and_loads_in_transformers(tmp_path, card, save_layout, save_np,
                                                                        load_layout, load_np):
    from transformers import AutoModelForCausalLM

    hf = init_random_weights(card, tmp_path / "hf", seed=3)
    if card == TINY_DEEPSEEK:  # a published checkpoint's MTP layer beside a config with num_nextn_predict_layers 0
        save_file({"model.layers.4.eh_proj.weight": torch.randn(64, 128), "model.layers.4.enorm.weight": torch.ones(64)},
                  str(hf / "model-mtp.safetensors"))
    r = convert("hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mcore"), "--allocation", save_layout,
                nproc=save_np)
    assert r.returncode == 0, r.stderr[-4000:]
    args = ["mcore-to-hf", "--mcore", str(tmp_path / "mcore"), "--out", str(tmp_path / "back")]
    r = convert(*args, *(["--allocation", load_layout] if load_layout else []), nproc=load_np)
    assert r.returncode == 0, r.stderr[-4000:]
    assert same_weights(hf, tmp_path / "back")
    tokens = torch.randint(1, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # what a run's final_hf is (the same writer): transformers loads it, every weight used
        a, info = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32, output_loading_info=True)
        b = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        assert not any(info.values()), info
        assert torch.equal(a(tokens).logits, b(tokens).logits)


def test_clear_errors(tmp_path):
    r = convert("hf-to-mcore", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "is not an HF model directory" in r.stderr
    r = convert("mcore-to-hf", "--mcore", str(tmp_path), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "not a checkpoint written by hf-to-mcore" in r.stderr
    hf = init_random_weights(TINY_MOE, tmp_path / "hf", seed=0)
    r = convert("hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "o"), "--allocation", "megatron:t3")
    assert r.returncode == 2 and "tp=3 does not divide num_attention_heads=4" in r.stderr
    sd = load_file(str(hf / "model.safetensors"))
    sd["model.norm.weight"] = torch.ones(65)  # shape disagrees with the config
    save_file(sd, str(hf / "model.safetensors"))
    r = convert("hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "model.norm.weight" in r.stderr and "(65,)" in r.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
