"""`mega-async train --resume` on copies of a real tiny run whose newest checkpoint was damaged one way each
(issue 24's table): the last line printed is `mega-async train: CheckpointError: <path>: <what>; <fix>`, exit
code 2, and no server was started; the intact copy resumes and finishes. The unit-level rows are in
tests/unit/test_checkpoint_damage.py (default suite); this runs the real writer's checkpoint through the CLI."""
import io
import json
import math
import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mega_async.checkpoint.format import latest_checkpoint
from mega_async.checkpoint.check import write_manifest
from mega_async.bridge.model_cards import TINY_MOE, init_random_weights
from tests.commands import train_command

ROOT = Path(__file__).resolve().parents[2]
BASE = ["trainer.save_interval=1", "rollout.consumer_batch_size=4", "rollout.max_new_tokens=16",
        "logging.tensorboard=false", "trainer.verify_sync=false", "trainer.weight_sync=disk", "trainer.warmup_steps=0"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def train(root: Path, model: Path, *extra: str, trial="run0", resume=False) -> subprocess.CompletedProcess:
    cmd = train_command("tiny_cpu", root, f"model.path={model}", f"trial_name={trial}", *BASE, *extra,
                        tensorboard=True)
    return subprocess.run(cmd + (["--resume"] if resume else []), cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run (checkpoints after steps 0 and 1) and its model card."""
    tmp = tmp_path_factory.mktemp("damage")
    model = init_random_weights(TINY_MOE, tmp / "model", seed=0)
    r = train(tmp / "runs", model, "trainer.total_steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "runs", model


def copy_run(finished, trial: str) -> tuple[Path, Path]:
    root, _ = finished
    src, dst = root / "tiny_cpu" / "run0", root / "tiny_cpu" / trial
    shutil.copytree(src, dst, symlinks=True)
    return dst, latest_checkpoint(dst)


def edit(path: Path, **fields):
    meta = json.loads(path.read_text())
    meta.update(fields)
    path.write_text(json.dumps(meta))


def truncate(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def nan_in_a_weight(ck: Path):
    """Point one weight's entry at a copy holding NaN, appended to its .distcp; re-sealed (a diverged run)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model = ck / "model"
    meta = pickle.loads((model / ".metadata").read_bytes())  # the test's own file
    idx = next(i for i in meta.storage_data
               if isinstance(meta.state_dict_metadata[i.fqn], TensorStorageMetadata) and "weight" in i.fqn
               and "optimizer" not in i.fqn)
    info = meta.storage_data[idx]
    f = model / info.relative_path
    with f.open("rb") as fh:
        fh.seek(info.offset)
        t = torch.load(io.BytesIO(fh.read(info.length)), weights_only=True).clone()
    t.view(-1)[0] = math.nan
    buf = io.BytesIO()
    torch.save(t, buf)
    info.offset, info.length = f.stat().st_size, len(buf.getvalue())
    with f.open("ab") as fh:
        fh.write(buf.getvalue())
    (model / ".metadata").write_bytes(pickle.dumps(meta))
    write_manifest(ck)
    return info.relative_path, idx.fqn


def other_card(tmp: Path, model: Path) -> Path:
    card = tmp / "other-card"
    shutil.copytree(model, card)
    cfg = json.loads((card / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (card / "config.json").write_text(json.dumps(cfg))
    for f in card.glob("*.safetensors"):
        f.unlink()
    return card


ROWS = {
    "trainer-string": (lambda run, ck: edit(ck / "trainer.json", version="2"), r"trainer\.json: "),
    "trainer-huge": (lambda run, ck: edit(ck / "trainer.json", metrics_bytes=10 ** 30), r"trainer\.json: "),
    "trainer-truncated": (lambda run, ck: truncate(ck / "trainer.json"), r"trainer\.json: \d+ bytes, manifest"),
    "trainer-negative-step": (lambda run, ck: edit(ck / "trainer.json", step=-1), r"trainer\.json: "),
    "rollout-truncated": (lambda run, ck: truncate(ck / "rollout.pt"), r"rollout\.pt: \d+ bytes, manifest"),
    "common-truncated": (lambda run, ck: truncate(ck / "model" / "common.pt"), r"common\.pt: \d+ bytes, manifest"),
    "distcp-missing": (lambda run, ck: (ck / "model" / "__0_0.distcp").unlink(), r"__0_0\.distcp: missing"),
    "distcp-truncated": (lambda run, ck: truncate(ck / "model" / "__0_1.distcp"), r"__0_1\.distcp: \d+ bytes"),
    "rollout-symlink": (lambda run, ck: ((ck / "rollout.pt").unlink(), os.symlink("/etc/passwd", ck / "rollout.pt")),
                        r"rollout\.pt: is a symbolic link \(to /etc/passwd\)"),
    "rng-missing": (lambda run, ck: shutil.rmtree(ck / "rng"), r"rng/rank0\.pt: missing"),
    "metrics-symlink": (lambda run, ck: ((run / "metrics.jsonl").rename(run.parent / "m.jsonl"),
                                         os.symlink(run.parent / "m.jsonl", run / "metrics.jsonl")),
                        r"metrics\.jsonl: is a symbolic link"),
    "checkpoint-symlink": (lambda run, ck: (shutil.move(ck, run.parent / "moved"),
                                            os.symlink(run.parent / "moved", ck)), r"step_00000001: is a symbolic link"),
}


def resume(finished, trial: str, *extra: str, model=None) -> tuple[subprocess.CompletedProcess, str]:
    """`mega-async train --resume` of the copy `trial`; returns the result and what it added to train.log."""
    log = finished[0] / "tiny_cpu" / trial / "train.log"
    before = log.stat().st_size if log.exists() else 0
    r = train(finished[0], model or finished[1], "trainer.total_steps=3", *extra, trial=trial, resume=True)
    return r, (log.read_bytes()[before:].decode(errors="replace") if log.exists() else "")


def check_refused(result: tuple[subprocess.CompletedProcess, str], pattern: str) -> str:
    r, log = result
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2, r.stderr[-3000:]
    assert last.startswith("mega-async train: CheckpointError: ") and re.search(pattern, last), last
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "starting server" not in log, log[-3000:]  # nothing started
    return last


@pytest.mark.parametrize("row", list(ROWS))
def test_damaged_checkpoint_is_refused_in_one_line(finished, row):
    damage, pattern = ROWS[row]
    run, ck = copy_run(finished, row)
    damage(run, ck)
    check_refused(resume(finished, row), pattern)


def test_nan_weights_are_refused_when_read_before_any_server_starts(finished):
    run, ck = copy_run(finished, "nan")
    rel, key = nan_in_a_weight(ck)
    check_refused(resume(finished, "nan"), rf"model/{re.escape(rel)}: {re.escape(key)} holds NaN or inf values")


def test_another_model_or_batch_size(finished, tmp_path):
    copy_run(finished, "other")
    check_refused(resume(finished, "other", model=other_card(tmp_path, finished[1])),
                  r"trainer\.json: the checkpoint is of another model \(intermediate_size=")
    check_refused(resume(finished, "other", "rollout.consumer_batch_size=8"),
                  r"rollout\.consumer_batch_size=4, this config has 8; .*trainer\.resume_override")
    check_refused(resume(finished, "other", "data.synthetic_target=9"), r"data\.synthetic_target=7, this config has 9")


def test_intact_copy_resumes_with_an_override_and_logs_it(finished):
    run, ck = copy_run(finished, "intact")
    r, log = resume(finished, "intact", "rollout.consumer_batch_size=8",
                    "trainer.resume_override=[rollout.consumer_batch_size]")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "with rollout.consumer_batch_size=8 (the checkpoint's run had 4): trainer.resume_override allows it" in log
    took = re.search(r"checkpoint \S+step_00000001 checked in ([\d.]+)s \(manifest, sizes and sha256\)", log)
    assert took, log[-3000:]
    print(f"validation of the tiny run's checkpoint: {took.group(1)} s")
    assert latest_checkpoint(run).name == "step_00000002"
