"""tools/convert_checkpoint.py both ways, single process and under torchrun; round trips are bit-identical."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mega_async.utils.comm import free_port
from mega_async.bridge.model_cards import TINY_DEEPSEEK, TINY_DENSE, TINY_GLM, TINY_MOE, init_random_weights
from tests.dist.jobs import run_grouped

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


ROUND_TRIPS = {  # id: (card, save layout, save ranks, load layout, load ranks)
    "moe-tp2-to-1": ("moe", "megatron:t2", 2, None, 1),  # TP2 checkpoint, read back on one rank
    "moe-1-to-ep2": ("moe", "megatron:d1", 1, "megatron:d2e2", 2),  # one-rank checkpoint, exported from EP2
    "dense-pp2-to-tp2": ("dense", "megatron:p2", 2, "megatron:t2", 2),  # PP2 checkpoint resharded to TP2
}


def record(path: Path) -> dict:
    """What convert_job.py wrote for one conversion: rank 0's exit code, stdout, stderr."""
    return json.loads(Path(f"{path}.rank0.json").read_text())


def dist_jobs(weights: dict, out: Path) -> dict:
    """The first half of every round trip (HF -> Megatron) and the errors that need a model built, run by conftest's
    dist_runs with other modules' jobs (an error is recorded and the launch goes on); `conversions` runs the loads."""
    hf = {"moe": init_random_weights(TINY_MOE, out / "hf_moe", seed=3),
          "dense": init_random_weights(TINY_DENSE, out / "hf_dense", seed=3)}
    bad = init_random_weights(TINY_MOE, out / "hf_bad", seed=0)
    sd = load_file(str(bad / "model.safetensors"))
    sd["model.norm.weight"] = torch.ones(65)  # shape disagrees with the config
    save_file(sd, str(bad / "model.safetensors"))
    saves = {f"{name}.save": (save_np, ["convert_job.py", str(out / name / "save"), "hf-to-mcore", "--hf",
                                        str(hf[card]), "--out", str(out / name / "mcore"), "--allocation", save_layout])
             for name, (card, save_layout, save_np, _, _) in ROUND_TRIPS.items()}
    return {**saves,
            "tp3": (1, ["convert_job.py", str(out / "tp3"), "hf-to-mcore", "--hf", str(hf["moe"]), "--out",
                        str(out / "o_tp3"), "--allocation", "megatron:t3"]),
            "shape": (1, ["convert_job.py", str(out / "shape"), "hf-to-mcore", "--hf", str(bad), "--out",
                          str(out / "o_shape")])}


@pytest.fixture(scope="module")
def conversions(dist_runs):
    """The saves' results (dist_runs) and the loads of every round trip, run here: {job: error or None}."""
    root = dist_runs.out(__name__)
    loads = {f"{name}.load": (load_np, ["convert_job.py", str(root / name / "load"), "mcore-to-hf", "--mcore",
                                        str(root / name / "mcore"), "--out", str(root / name / "back"),
                                        *(["--allocation", load_layout] if load_layout else [])])
             for name, (_, _, _, load_layout, load_np) in ROUND_TRIPS.items()}
    results = {**dist_runs.of(__name__), **run_grouped(loads, root / "loads")}
    return root, {"moe": root / "hf_moe", "dense": root / "hf_dense"}, results


@pytest.mark.parametrize("name", list(ROUND_TRIPS))
def test_round_trip_is_bit_identical(conversions, name):
    root, hf, results = conversions
    card, save_layout, *_ = ROUND_TRIPS[name]
    d = root / name
    assert results[f"{name}.save"] is None, results[f"{name}.save"]
    r = record(d / "save")
    assert r["code"] == 0, r["stderr"][-4000:]
    assert "converted hf-to-mcore:" in r["stdout"] and "tensors" in r["stdout"]
    meta = json.loads((d / "mcore" / "mega_async_meta.json").read_text())
    assert meta["allocation"] == save_layout
    assert results[f"{name}.load"] is None, results[f"{name}.load"]
    r = record(d / "load")
    assert r["code"] == 0, r["stderr"][-4000:]
    assert "converted mcore-to-hf:" in r["stdout"]
    assert same_weights(hf[card], d / "back")
    assert (d / "back" / "tokenizer.json").exists() and (d / "back" / "config.json").exists()
    assert not list(d.glob("*.partial*"))


@pytest.mark.slow  # four torchrun launches
@pytest.mark.parametrize("card, save_layout, save_np, load_layout, load_np, mtp", [
    # MLA shards, the router bias and the MTP layer (as published) at TP2, read back on one rank
    (TINY_DEEPSEEK, "megatron:t2", 2, None, 1, 1),
    # exported from EP2; a config with num_nextn_predict_layers 0 beside the checkpoint's MTP layer drops it
    (TINY_GLM, "megatron:d1", 1, "megatron:d2e2", 2, 0),
    # the MTP layer on the last stage with its copy of the embedding (tied to stage 0's in the checkpoint)
    (TINY_DEEPSEEK, "megatron:p2", 2, "megatron:p2", 2, 1),
], ids=["deepseek-tp2-to-1", "glm-1-to-ep2", "deepseek-pp2-to-pp2"])
def test_family_round_trip_is_bit_identical_and_loads_in_transformers(tmp_path, card, save_layout, save_np,
                                                                        load_layout, load_np, mtp):
    from transformers import AutoModelForCausalLM

    hf = init_random_weights(card, tmp_path / "hf", seed=3)
    src = load_file(str(hf / "model.safetensors"))
    assert "model.layers.4.eh_proj.weight" in src and "model.layers.4.shared_head.head.weight" in src  # the card's
    if not mtp:
        cfg = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    r = convert("hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mcore"), "--allocation", save_layout,
                nproc=save_np)
    assert r.returncode == 0, r.stderr[-4000:]
    args = ["mcore-to-hf", "--mcore", str(tmp_path / "mcore"), "--out", str(tmp_path / "back")]
    r = convert(*args, *(["--allocation", load_layout] if load_layout else []), nproc=load_np)
    assert r.returncode == 0, r.stderr[-4000:]
    back = {k: v for f in sorted((tmp_path / "back").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    # (one file, or one per pipeline stage under an index)
    want = {k: v for k, v in src.items() if mtp or not k.startswith("model.layers.4.")}
    assert back.keys() == want.keys()
    assert all(torch.equal(back[k], want[k]) and back[k].dtype == want[k].dtype for k in want)
    tokens = torch.randint(1, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # what a run's final_hf is (the same writer): transformers loads it, every weight used
        a, info = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32, output_loading_info=True)
        b = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        # transformers builds no MTP layer: its tensors are the only ones it does not take
        assert not info["missing_keys"] and not info["mismatched_keys"], info
        assert all(k.startswith("model.layers.4.") for k in info["unexpected_keys"]), info
        assert bool(info["unexpected_keys"]) == bool(mtp)
        assert torch.equal(a(tokens).logits, b(tokens).logits)


def test_clear_errors(tmp_path, conversions):
    # found before any model is built: the tool itself, each in its own process
    r = convert("hf-to-mcore", "--hf", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "is not an HF model directory" in r.stderr
    r = convert("mcore-to-hf", "--mcore", str(tmp_path), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "not a checkpoint written by hf-to-mcore" in r.stderr
    # found while the model is built or loaded: jobs of the shared launch
    root, _, results = conversions
    assert results["tp3"] is None and results["shape"] is None, results
    r = record(root / "tp3")
    assert r["code"] == 2 and "tp=3 does not divide num_attention_heads=4" in r["stderr"]
    r = record(root / "shape")
    assert r["code"] == 2 and "model.norm.weight" in r["stderr"] and "(65,)" in r["stderr"]
    assert not (root / "o_shape").exists() and not list(root.glob("o_shape.partial*"))
