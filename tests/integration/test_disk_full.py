"""A full disk, on a small tmpfs (mounted as root; skipped where mounting is not allowed): a checkpoint says the disk
is full, where, and what it needs against what is free, and leaves the older checkpoints loadable; the run's logs
name the file they could not write and never end in a torn line."""
import contextlib
import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mega_async.utils.diskspace import DiskFull, read_jsonl
from mega_async.utils.events import EventLog, read_events
from mega_async.rollout.ledger import Ledger, read_ledger
from mega_async.run.console import RunDirFileHandler
from mega_async.run.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_fs(tmp_path):
    """mount(size) -> a directory on a fresh tmpfs of that size (unmounted after the test)."""
    mounted = []

    def mount(size: str) -> Path:
        d = tmp_path / f"fs{len(mounted)}"
        d.mkdir()
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True,
                           text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], check=False)


def fill(d: Path, leave: int = 4096) -> None:
    """Fill the filesystem of `d`, then free `leave` bytes (whole pages) of it."""
    fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for chunk in (1 << 20, 4096):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * chunk):
                    pass
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    finally:
        os.close(fd)


def test_a_checkpoint_on_a_full_disk_says_so_and_the_older_one_loads(small_fs, tmp_path):
    """Step 0 (7.2 MB) fits on 10 MB, step 1 does not: refused before writing (the free space is less than the state
    dict needs), and, with that check passed, the write running out of space is reported as a full disk, not as
    torch's `CheckpointException ranks:dict_keys([0])`. Step 0 stays intact and loads; no partial write is left."""
    from mega_async.bridge.model_cards import TINY_MOE, init_random_weights

    model = init_random_weights(TINY_MOE, tmp_path / "moe", seed=5)
    fs = small_fs("10m")
    out = tmp_path / "result.json"
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "integration" / "disk_full_worker.py"), "--model",
                        str(model), "--run-dir", str(fs / "run"), "--out", str(out)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    where = str(fs / "run" / "checkpoints")
    for case, when in (("refused", "is free there, so it was not started"), ("midwrite", "the disk filled up")):
        got = res[case]
        assert got["error"] == "DiskFull" and got["errno"] == errno.ENOSPC, got
        msg = got["message"]
        assert "\n" not in msg and "No space left on device".lower() in msg.lower() and where in msg, msg
        assert "step_00000001 not written" in msg and when in msg and "needs about " in msg, msg
        assert "MB (estimated from its state dict)" in msg and "older checkpoints are intact (newest: step_00000000" \
            in msg, msg
        assert "dict_keys" not in msg and "unexpected pos" not in msg.split("writer said")[0]
        assert got["left"] == ["step_00000000"]  # no .partial left taking the space
    assert res["latest"] == "step_00000000" and res["manifest_ok"] is True
    assert res["loaded"] == {"step": 0, "version": 1, "rollout": {"x": 1}} and res["weights_equal"]


def test_events_on_a_full_disk_never_end_in_a_torn_line(small_fs, caplog):
    fs = small_fs("256k")
    fill(fs)
    log = EventLog(fs / "events.jsonl")
    with caplog.at_level(logging.WARNING, logger="mega_async.utils.events"):
        for i in range(200):  # ~100 bytes each: the page fills, and one write is cut short
            log.emit("episode_finished", i=i, verdict="accepted", pad="x" * 40)
    log.close()
    data = (fs / "events.jsonl").read_bytes()
    assert data and data.endswith(b"\n")
    lines = data.decode().splitlines()
    assert 10 < len(lines) < 200 and all(json.loads(x)["kind"] == "episode_finished" for x in lines)
    assert len(read_events(fs / "events.jsonl")) == len(lines)
    warned = [r.getMessage() for r in caplog.records if "not writable" in r.getMessage()]
    assert len(warned) == 1 and str(fs / "events.jsonl") in warned[0] and "No space left on device" in warned[0]


def test_metrics_and_ledger_on_a_full_disk_name_the_file(small_fs):
    fs = small_fs("256k")
    fill(fs)
    metrics = Metrics(fs, tensorboard=False)
    with pytest.raises(DiskFull, match=r"metrics\.jsonl: No space left on device"):
        for step in range(200):
            metrics.log(step, {"loss": 0.5, "pad": "x" * 60})
    metrics.close()
    assert (fs / "metrics.jsonl").read_bytes().endswith(b"\n")
    assert [m["step"] for m in read_jsonl(fs / "metrics.jsonl")] == list(range(step))
    (fs / "metrics.jsonl").unlink()
    ledger = Ledger(fs / "rollouts.jsonl")
    with pytest.raises(DiskFull, match=r"rollouts\.jsonl: No space left on device"):
        for i in range(200):
            ledger.write({"index": i, "epoch": 0, "pad": "x" * 60}, "accepted", 0)
    ledger.close()
    assert (fs / "rollouts.jsonl").read_bytes().endswith(b"\n") and len(read_ledger(fs / "rollouts.jsonl")) == i


def test_train_log_on_a_full_disk_is_named_once_on_stderr(small_fs, capsys):
    fs = small_fs("256k")
    fill(fs)
    handler = RunDirFileHandler(fs)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for i in range(300):
        handler.emit(logging.LogRecord("mega_async.x", logging.INFO, __file__, 1, "line %d " + "x" * 60, (i,), None))
    handler.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(fs / "train.log") in err[0] and "No space left on device" in err[0], err
    assert (fs / "train.log").read_bytes().endswith(b"\n")


def test_the_run_lock_on_a_full_or_read_only_disk_is_one_line_and_leaves_nothing(small_fs):
    """Taking a run directory's lock where it cannot be written: one line naming the problem and the fix (no
    OSError traceback), an existing lock file's record kept, and no new run directory left behind."""
    from mega_async.run.lock import LOCK_FILE, RunDirLock, RunDirLockError

    fs = small_fs("64k")
    old = fs / "exp" / "old"
    old.mkdir(parents=True)
    (old / LOCK_FILE).write_text("")  # a lock file from an earlier run, empty: the new record needs space
    fill(fs, leave=0)
    with pytest.raises(RunDirLockError, match=r"cannot lock the run directory .*No space left on device.*free some "
                                              r"space there"):
        RunDirLock.acquire(old)
    assert (old / LOCK_FILE).exists()  # kept, not emptied or removed
    with pytest.raises(RunDirLockError, match="No space left on device"):
        RunDirLock.acquire(fs / "exp" / "new" / "trial")
    assert sorted(p.name for p in (fs / "exp").iterdir()) == ["old"]  # no fresh run directory left behind
    (fs / "filler").unlink()
    subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
    for d in (fs / "exp" / "new", old):
        with pytest.raises(RunDirLockError, match=r"Read-only file system.*choose a writable logging.root_dir") as e:
            RunDirLock.acquire(d)
        assert "\n" not in str(e.value)


def test_an_hf_snapshot_that_cannot_fit_is_skipped_with_a_line_and_old_ones_are_pruned(small_fs, tmp_path, caplog):
    """Before an HF snapshot, its size from the model card against the free space: one that cannot fit is skipped
    with a warning naming what it needs (the run and its checkpoints go on; before, safetensors' `No space left on
    device (os error 28)` ended the run); trainer.hf_snapshot_keep keeps the newest."""
    from mega_async.api.config_load import load_config
    from mega_async.run.checkpointer import Checkpointer, prune_snapshots
    from mega_async.utils.outputs import mark

    fs = small_fs("1m")  # the tiny card's fp32 snapshot needs about 1.5 MB
    cfg = load_config("configs/tiny_cpu.yaml", [f"logging.root_dir={fs}", "trainer.hf_snapshot_interval=1",
                                                "trainer.hf_snapshot_keep=2"])
    (cfg.run_dir / "hf_snapshots").mkdir(parents=True)
    ck = Checkpointer(cfg)
    with caplog.at_level(logging.WARNING, logger="mega_async"):
        ck._snapshot(3)  # skipped before any write: no engine is even needed
    assert any("HF snapshot step_3 skipped: it needs about" in r.getMessage() and "free space there" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert list((cfg.run_dir / "hf_snapshots").iterdir()) == []
    snaps = tmp_path / "snaps"
    for s in (0, 1, 2, 10):
        mark((snaps / f"step_{s}").mkdir(parents=True) or snaps / f"step_{s}", "hf")
    (snaps / "step_5").mkdir()  # not an export: left alone
    assert sorted(p.name for p in prune_snapshots(snaps, 2)) == ["step_0", "step_1"]
    assert sorted(p.name for p in snaps.iterdir()) == ["step_10", "step_2", "step_5"]
