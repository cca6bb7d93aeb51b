"""Checkpoints of the trainer: model, optimizer, LR schedule and RNG survive a save and a load, at the same
layout and at another one; crafted pickles in a checkpoint are refused before anything unpickles them."""
import json
import pickle
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mega_async.checkpoint.format import CheckpointError, check_dist_checkpoint, latest_checkpoint
from mega_async.checkpoint.check import verify_manifest, write_manifest
from mega_async.bridge.model_cards import TINY_MOE, init_random_weights
from tests.dist.jobs import run_grouped, torchrun
from tests.unit.test_untrusted_checkpoint import poisoned

pytestmark = pytest.mark.slow  # six torchrun launches: CI's second step (the rollout side and the untrusted-file
# checks run in the default suite: tests/unit/test_rollout_checkpoint.py, test_untrusted_checkpoint.py)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return init_random_weights(TINY_MOE, tmp_path_factory.mktemp("ck") / "moe", seed=0)


def run(mode, moe, layout, nproc, run_dir, out):
    torchrun("checkpoint_worker.py", nproc, "--mode", mode, "--model", str(moe), "--layout", layout,
             "--run-dir", str(run_dir), "--out", str(out))
    return load_file(str(out / "weights.safetensors")), json.loads((out / "stats.json").read_text())


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


RESUMES = {"same-layout": ("megatron:d1", 1, "megatron:d1", 1),
           "tp2-to-1": ("megatron:t2", 2, "megatron:d1", 1),  # another layout: TP2 -> one rank
           "ep2dp2": ("megatron:d2e2", 2, "megatron:d2e2", 2)}  # DP2 x EP2: dense and expert optimizers
SAVES = {**{name: (layout, n) for name, (layout, n, _, _) in RESUMES.items()},
         "refused": ("megatron:d2e2", 2), "crafted": ("megatron:d1", 1)}


def job(mode, moe, layout, root, name, out):
    return ["checkpoint_worker.py", "--mode", mode, "--model", str(moe), "--layout", layout,
            "--run-dir", str(root / name / "run"), "--out", str(root / name / out)]


@pytest.fixture(scope="module")
def saved(moe, tmp_path_factory):
    """Every save of this module (a run to a checkpoint, then one more step: the uninterrupted reference), in one
    launch per rank count (jobs.run_grouped): name -> its folder."""
    root = tmp_path_factory.mktemp("saved")
    errors = run_grouped({name: (n, job("save", moe, layout, root, name, "continuous"))
                          for name, (layout, n) in SAVES.items()}, root / "launches")
    assert all(e is None for e in errors.values()), errors
    return {name: root / name for name in SAVES}


@pytest.fixture(scope="module")
def resumed(moe, saved, tmp_path_factory):
    root = tmp_path_factory.mktemp("resumed")
    errors = run_grouped({name: (n, ["checkpoint_worker.py", "--mode", "load", "--model", str(moe), "--layout", layout,
                                     "--run-dir", str(saved[name] / "run"), "--out", str(saved[name] / "resumed")])
                          for name, (_, _, layout, n) in RESUMES.items()}, root)
    return errors


def read(out):
    return load_file(str(out / "weights.safetensors")), json.loads((out / "stats.json").read_text())


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_equals_an_uninterrupted_run(saved, resumed, name):
    save_layout, _, load_layout, _ = RESUMES[name]
    run_dir = saved[name] / "run"
    cont_w, cont = read(saved[name] / "continuous")
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.name == "step_00000000" and not list(ckpt.parent.glob("*.partial"))
    assert resumed[name] is None, resumed[name]
    res_w, res = read(saved[name] / "resumed")
    assert res["lr"] == pytest.approx(cont["lr"], rel=1e-9)  # the LR schedule continued (warmup + cosine)
    tol = 1e-6 if save_layout == load_layout else 2e-5
    assert max_diff(res_w, cont_w) < tol  # Adam moments restored: the same update as without the restart
    if save_layout == load_layout:
        assert res["draw"] == cont["draw"]  # RNG states restored


def test_a_resume_that_would_split_the_optimizer_differently_is_refused(moe, saved, tmp_path):
    with pytest.raises(AssertionError, match=r"CheckpointError: .*optimizer has 2 parts .*this layout's has 1"):
        run("load", moe, "megatron:d1", 1, saved["refused"] / "run", tmp_path / "r")


def test_crafted_pickles_are_refused(moe, saved, tmp_path):
    run_dir = saved["crafted"] / "run"
    ckpt = latest_checkpoint(run_dir)
    model = ckpt / "model"
    t0 = time.monotonic()
    assert verify_manifest(ckpt)  # sealed: every file's size and sha256
    check_dist_checkpoint(model)  # a genuine checkpoint passes (its _extra_state objects read tensors-only)
    print(f"manifest + model checks of a real tiny checkpoint: {time.monotonic() - t0:.2f} s")
    # a layer's _extra_state entry pointed at a torch.save'd payload appended to its .distcp, re-sealed
    mark = tmp_path / "pwned"
    poisoned(model, mark)
    write_manifest(ckpt)
    with pytest.raises(AssertionError, match=r"CheckpointError: .*__0_\d\.distcp: .*_extra_state.*: refused to load"):
        run("load", moe, "megatron:d1", 1, run_dir, tmp_path / "r")
    assert not mark.exists()

    class Evil:
        def __reduce__(self):
            return (exec, ("open('/tmp/pwned_by_checkpoint', 'w').write('x')",))

    (model / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to load: builtins\.exec is not a checkpoint"):
        check_dist_checkpoint(model)
    assert not Path("/tmp/pwned_by_checkpoint").exists()
