"""One live run per run directory (mega_async/run/lock.py, launch/slurm/lib.sh's ma_lock_run_dir): a second
holder is refused in one line naming the first (pid, host, start), nothing in the directory changes, and the
lock goes with its holder however it ends (kill -9 included)."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mega_async.run.lock import LOCK_FILE, RunDirInUse, RunDirLock, RunDirLockError, holder

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "launch" / "slurm" / "lib.sh"
HOLD = ("import sys, time; from mega_async.run.lock import RunDirLock; RunDirLock.acquire(sys.argv[1]); "
        "print('held', flush=True); time.sleep(120)")


def _hold(run_dir: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir), "train", "-c", "x.yaml"], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_run_is_refused_naming_the_holder_until_it_is_killed(tmp_path):
    run = tmp_path / "run0"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    p = _hold(run)
    try:
        before = {f.name: f.read_bytes() for f in run.iterdir()}
        with pytest.raises(RunDirInUse) as e:
            RunDirLock.acquire(run)
        msg = str(e.value)
        assert "\n" not in msg and f"is in use by another run (pid {p.pid} on host {socket.gethostname()}, started " \
            in msg and f"(kill {p.pid})" in msg, msg
        assert {f.name: f.read_bytes() for f in run.iterdir()} == before  # nothing written, nothing truncated
        assert holder(run)["pid"] == p.pid
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    lock = RunDirLock.acquire(run)  # the kernel dropped the dead holder's lock
    assert holder(run)["pid"] == os.getpid()
    lock.release()
    assert (run / "metrics.jsonl").exists() and (run / LOCK_FILE).exists()  # a run directory in use is kept


def test_a_refused_start_leaves_no_directory_behind(tmp_path):
    lock = RunDirLock.acquire(tmp_path / "runs" / "exp" / "run0")
    assert json.loads((tmp_path / "runs" / "exp" / "run0" / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert list(tmp_path.iterdir()) == []  # every folder it made, and only those
    (tmp_path / "runs").mkdir()
    RunDirLock.acquire(tmp_path / "runs" / "run1").release()
    assert [p.name for p in tmp_path.iterdir()] == ["runs"] and not any((tmp_path / "runs").iterdir())


def test_a_link_at_the_lock_file_is_refused_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    run = tmp_path / "run0"
    run.mkdir()
    (run / LOCK_FILE).symlink_to(target)
    with pytest.raises(RunDirLockError, match="is a symbolic link"):
        RunDirLock.acquire(run)
    assert target.read_text() == "keep"


def _bash_lock(run: Path, then: str = "") -> subprocess.Popen:
    script = f'source "{LIB}"; ma_lock_run_dir; echo "held $MEGA_ASYNC_RUN_LOCKED"; {then}'
    return subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"RUN_DIR": str(run), "PATH": os.environ["PATH"], "SLURM_JOB_ID": "41"})


def test_the_slurm_job_holds_the_run_directory(tmp_path):
    run = tmp_path / "run0"
    job = _bash_lock(run, "sleep 60")
    try:
        assert job.stdout.readline().strip() == f"held {run}"
        info = holder(run)
        assert info["slurm_job"] == "41" and info["pid"] == job.pid
        with pytest.raises(RunDirInUse, match="slurm job 41"):  # a `mega-async train` of another job
            RunDirLock.acquire(run)
        second = _bash_lock(run)
        _, err = second.communicate(timeout=30)
        assert second.returncode == 2 and "\n" not in err.strip() and f"run directory {run} is in use by another " \
            f"run (" in err and '"slurm_job": "41"' in err, err
    finally:
        job.kill()
        job.wait()
    with RunDirLock.acquire(run) as lock:  # gone with the job
        assert lock.fd is not None
    holding = RunDirLock.acquire(run)
    try:  # and a job cannot take a directory a local run holds
        second = _bash_lock(run)
        _, err = second.communicate(timeout=30)
        assert second.returncode == 2 and f'"pid": {os.getpid()}' in err
    finally:
        holding.release()


def test_a_start_waits_for_the_stopping_processes_of_a_run_that_just_ended(tmp_path):
    """A kill -9 of the command leaves the lock a few seconds to what it started (the local launcher's torchrun
    agent; a checkpoint writer Megatron forked): a start waits for them (ENDED_WAIT_S), then names them."""
    code = ("import subprocess, sys; from mega_async.run.lock import RunDirLock; "
            "lock = RunDirLock.acquire(sys.argv[1]); print(subprocess.Popen(['sleep', '60'], pass_fds=(lock.fd,), "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = int(r.stdout)
    try:
        with pytest.raises(RunDirInUse, match=r"is still held by processes of a run that ended \(pid .*`fuser "):
            RunDirLock.acquire(tmp_path, wait_for_ended=0.5)
        threading.Timer(1.0, os.kill, (child, signal.SIGKILL)).start()
        t0 = time.monotonic()
        RunDirLock.acquire(tmp_path).release()  # waits for it
        assert 0.9 < time.monotonic() - t0 < 10
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_lock_file_that_is_no_file_is_refused_in_one_line(tmp_path, kind):
    import os

    from mega_async.run.lock import LOCK_FILE, RunDirLock, RunDirLockError

    run = tmp_path / "run"
    run.mkdir()
    if kind == "directory":
        (run / LOCK_FILE).mkdir()
    else:
        os.mkfifo(run / LOCK_FILE)
    with pytest.raises(RunDirLockError, match="not the run's lock file: remove it, or choose another trial_name"):
        RunDirLock.acquire(run)
    assert (run / LOCK_FILE).exists()
