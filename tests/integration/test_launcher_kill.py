"""Whatever ends `mega-async train` ends its whole process tree within seconds, and one run directory belongs to
one live run (issue 33, items 1, 2, 8, 13): with two trainer ranks (torchrun started by the command) a second
`mega-async train`, with or without --resume, is refused in one line naming the live run and writes nothing, and
`kill -9` of the command then ends torchrun, both ranks, the server and Megatron's checkpoint writers; on the
one-rank path (the driver starts the server itself) kill -9 and SIGHUP do the same; a rank killed by a signal
is named with the signal. Each case prints how long the last process took to go."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from mega_async.bridge.model_cards import TINY_MOE, init_random_weights
from mega_async.run.lock import RunDirLock
from tests.commands import train_command

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
pytestmark = pytest.mark.slow  # each case runs the tiny job to its first checkpoint (40-70 s on 2 loaded cores)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return init_random_weights(TINY_MOE, tmp_path_factory.mktemp("kill") / "moe", seed=5)


def train_cmd(model: Path, tmp: Path, allocation: str, *extra: str) -> list[str]:
    return train_command("tiny_cpu", tmp / "runs", f"model.path={model}", f"parallel.allocation={allocation}",
                         "trainer.total_steps=200", "trainer.save_interval=1", "rollout.max_new_tokens=16",
                         "trainer.sync_timeout=60", *extra)


def start(model: Path, tmp: Path, allocation: str) -> tuple[subprocess.Popen, Path, list[psutil.Process]]:
    """The job, once it finished a step and wrote a checkpoint (Megatron's writer exists then), with its tree."""
    with open(tmp / "stderr.txt", "w") as err:  # a file, not a pipe: a leftover holding it cannot block the test
        # SIGHUP's default disposition: a CI started under nohup passes SIG_IGN down, and an ignored SIGHUP is
        # rightly left ignored by the command
        p = subprocess.Popen(train_cmd(model, tmp, allocation), stdout=subprocess.DEVNULL, stderr=err,
                             start_new_session=True, env=ENV,
                             preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    run = tmp / "runs" / "tiny_cpu" / "run0"
    deadline = time.monotonic() + 400
    tree: list[psutil.Process] = []
    try:
        while not (steps(run) and list((run / "checkpoints").glob("step_*[0-9]"))):
            assert p.poll() is None, stderr(tmp)[-4000:]
            assert time.monotonic() < deadline, "no step and checkpoint in 400 s"
            time.sleep(0.5)
        tree = psutil.Process(p.pid).children(recursive=True)
        cmds = " ".join(_cmd(c) for c in tree)
        assert "mega_async.server" in cmds and writer_managers(tree), cmds
    except BaseException:  # the job (200 steps) must not outlive a failed start
        cleanup(p, tree or _tree(p))
        raise
    return p, run, tree


def _tree(p: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(p.pid).children(recursive=True)
    except psutil.Error:
        return []


def writer_managers(tree: list[psutil.Process]) -> list[psutil.Process]:
    """The checkpoint writer's result managers in `tree`: a trainer rank's child that is its fork (same command
    line: CPU) or a spawned interpreter (`spawn_main`: CUDA)."""
    out = []
    for c in tree:
        try:
            parent = _cmd(c.parent()) if c.parent() else ""
        except psutil.Error:
            continue
        if "-m mega_async.cli train" in parent and (_cmd(c) == parent or "spawn_main" in _cmd(c)):
            out.append(c)
    return out


def stderr(tmp: Path) -> str:
    return (tmp / "stderr.txt").read_text()


def steps(run: Path) -> list[int]:
    f = run / "metrics.jsonl"
    return [json.loads(x)["step"] for x in f.read_text().splitlines()] if f.exists() else []


def gone(tree: list[psutil.Process], timeout: float) -> float:
    """Seconds until every process of `tree` has ended; fails naming those left (and kills them)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not [c for c in tree if _running(c)]:
            return time.monotonic() - t0
        time.sleep(0.05)
    left = [c for c in tree if _running(c)]
    names = [_cmd(c)[:120] for c in left]
    for c in left:
        c.kill()
    pytest.fail(f"{len(left)} processes still running {timeout:.0f}s later: {names}")


def _cmd(c: psutil.Process) -> str:
    try:
        return " ".join(c.cmdline())
    except psutil.Error:  # Megatron's per-save writers come and go
        return ""


def _running(c: psutil.Process) -> bool:
    try:
        return c.is_running() and c.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def cleanup(p: subprocess.Popen, tree: list[psutil.Process]) -> None:
    """A failing case leaves nothing running."""
    if p.poll() is None:
        p.kill()
    for c in tree:
        if _running(c):
            c.kill()


def test_second_run_is_refused_and_kill_9_of_the_command_ends_every_rank(model, tmp_path):
    p, run, tree = start(model, tmp_path, "sglang:d1+megatron:d1t2")
    try:
        for extra in (["--resume"], []):  # item 2: refused in one line naming the live run, nothing written
            metrics = (run / "metrics.jsonl").read_bytes()
            second = subprocess.Popen(train_cmd(model, tmp_path, "sglang:d1+megatron:d1t2", *extra), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
            try:
                out, err = second.communicate(timeout=120)  # a refusal takes seconds
            except subprocess.TimeoutExpired:
                tree += psutil.Process(second.pid).children(recursive=True) + [psutil.Process(second.pid)]
                pytest.fail("a second run started beside the live one")
            assert second.returncode == 2 and out == "", err[-3000:]
            line = err.strip()
            assert "\n" not in line and line.startswith(f"mega-async train: run directory {run} is in use by another "
                                                        f"run (pid {p.pid} on host "), line
            assert (run / "metrics.jsonl").read_bytes().startswith(metrics)  # not cut back under the live run
        s = steps(run)
        assert s == list(range(len(s)))
        p.send_signal(signal.SIGKILL)  # item 1: no handler runs in the command
        took = gone(tree, 20)
        print(f"kill -9 of mega-async train (2 ranks): every process gone {took:.2f}s later")
        assert took < 10
        n = len(steps(run))
        time.sleep(3)
        assert len(steps(run)) == n  # nobody trains on
        with RunDirLock.acquire(run):  # and the directory is free again
            pass
    finally:
        cleanup(p, tree)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGHUP"])
def test_one_rank_driver_killed_or_hung_up_takes_its_server_and_writer(model, tmp_path, sig):
    p, run, tree = start(model, tmp_path, "sglang:d1+megatron:d1")
    try:
        p.send_signal(getattr(signal, sig))
        p.wait(timeout=120)
        took = gone(tree, 20)
        err = stderr(tmp_path)
        print(f"{sig} to the one-rank driver: every process gone {took:.2f}s after it ended")
        assert took < 10
        if sig == "SIGHUP":  # a closed terminal: stopped as SIGTERM would, and said so
            assert p.returncode == 128 + signal.SIGHUP, err[-3000:]
            last = err.strip().splitlines()[-1]
            assert last.startswith("mega-async train: stopped by SIGHUP (its terminal or ssh session closed); last "
                                   "checkpoint step_"), last
            assert last.endswith(": continue with --resume"), last
    finally:
        cleanup(p, tree)


def test_a_rank_killed_by_a_signal_is_named(model, tmp_path):
    p, run, tree = start(model, tmp_path, "sglang:d1+megatron:d1t2")
    try:
        agent = psutil.Process(p.pid).children()[0]  # torchrun's agent: its children are the ranks
        rank1 = next(c for c in agent.children() if c.environ().get("RANK") == "1")
        rank1.send_signal(signal.SIGKILL)
        p.wait(timeout=120)
        assert p.returncode != 0
        last = stderr(tmp_path).strip().splitlines()[-1]
        assert last.startswith(f"mega-async train: trainer rank 1 was killed by SIGKILL (pid {rank1.pid}); last "
                               "checkpoint step_"), last
        took = gone(tree, 20)
        print(f"rank 1 SIGKILLed: every process gone {took:.2f}s after the command ended")
    finally:
        cleanup(p, tree)
