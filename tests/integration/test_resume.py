"""Crash and resume: the driver is stopped by SIGUSR1 (pre-emption) and killed with SIGKILL at several points
(during a checkpoint write, during a weight sync, at random moments), resumed each time, and the rollout
ledger shows that every drawn dataset index was consumed at most once, none lost (each is in the ledger or in
the final checkpoint), no rollout trained on twice, and the staleness bound held throughout."""
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from mega_async.checkpoint.format import latest_checkpoint
from mega_async.rollout.dataloader import EpochLoader
from mega_async.rollout.ledger import read_ledger
from tests.commands import train_command

ROOT = Path(__file__).resolve().parents[2]
STEPS, B, ETA = 8, 4, 1
OVERRIDES = [f"trainer.total_steps={STEPS}", "trainer.save_interval=1", f"rollout.consumer_batch_size={B}",
             f"rollout.max_staleness={ETA}", "rollout.max_new_tokens=16", "logging.tensorboard=false",
             "trainer.verify_sync=false", "trainer.resume=auto"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def start(root: Path, log: Path) -> subprocess.Popen:
    cmd = train_command("tiny_cpu", root, *OVERRIDES, tensorboard=True)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_for(cond, proc, log: Path, timeout=600, poll=0.05) -> bool:
    """True once `cond()` holds; False if the run ended first (successfully)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if proc.poll() is not None:
            assert proc.returncode == 0, f"the run failed before its stop point:\n{log.read_text()[-3000:]}"
            return False
        time.sleep(poll)
    stacks = "(py-spy not installed: no stacks)"
    if shutil.which("py-spy"):
        spy = subprocess.run(["py-spy", "dump", "--subprocesses", "--pid", str(proc.pid)], capture_output=True,
                             text=True, timeout=60)
        stacks = spy.stdout + spy.stderr
    raise AssertionError(f"timed out waiting for the stop point; driver log:\n{log.read_text()[-4000:]}\n{stacks}")


def in_weight_sync(run: Path, since: float) -> bool:
    """The newest whole-sync event on the timeline, written after `since` (unix time: by the process being
    watched, not by the one killed before it), is a start: the trainer is pushing weights right now."""
    p = run / "events.jsonl"
    if not p.exists():
        return False
    with p.open("rb") as f:
        f.seek(max(0, p.stat().st_size - 8192))
        tail = f.read().decode(errors="replace").splitlines()[1:]
    for line in reversed(tail):
        if '"phase": "push"' in line:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            return ev["t"] >= since and ev["kind"] == "sync_start"
    return False


def partial_since(run: Path, since: float) -> bool:
    """A checkpoint write begun after `since` is under way (not a leftover of the run killed before)."""
    for d in (run / "checkpoints").glob("*.partial"):
        try:
            if d.stat().st_mtime >= since:
                return True
        except FileNotFoundError:  # renamed meanwhile: the write finished
            pass
    return False


def metrics_lines(run: Path) -> int:
    p = run / "metrics.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


def server_ports(run: Path) -> list[int]:
    log = run / "train.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return [int(line.split("--port ")[1].split()[0]) for line in text.splitlines() if "starting server" in line]


def port_open(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
        return True
    except OSError:
        return False


def test_crash_and_resume_lose_nothing_and_train_nothing_twice(tmp_path):
    root, log = tmp_path / "runs", tmp_path / "driver.log"
    run = root / "tiny_cpu" / "run0"
    rng = random.Random(int(os.environ.get("MEGA_ASYNC_RESUME_SEED", "0")))  # vary the kill moments by hand
    # 1) pre-emption: SIGUSR1 -> checkpoint at the step boundary, exit 0
    p = start(root, log)
    assert wait_for(lambda: metrics_lines(run) >= 1, p, log)
    p.send_signal(signal.SIGUSR1)
    assert p.wait(timeout=300) == 0
    assert "preempted after step" in log.read_text()
    # 2) SIGKILL during a checkpoint write, during a weight sync, then at random moments after some steps
    points = [("checkpoint write", lambda since: partial_since(run, since)),
              ("weight sync", lambda since: in_weight_sync(run, since))]
    points += [(f"at a random moment after {k} more steps", k) for k in (1, 2)]
    for what, cond in points:
        since = time.time()
        p = start(root, log)
        if callable(cond):  # a sync of the tiny model takes ~0.1 s: poll often
            reached = wait_for(lambda: cond(since), p, log, poll=0.002)
            assert reached, f"the run ended before the driver could be killed ({what})"
        else:
            base = metrics_lines(run)
            reached = wait_for(lambda: metrics_lines(run) >= base + cond, p, log)
            time.sleep(rng.uniform(0.0, 3.0))
        if not reached or p.poll() is not None:
            break  # the run finished first: nothing left to kill
        os.killpg(p.pid, signal.SIGKILL)
        ports = server_ports(run)
        p.wait()
        deadline = time.monotonic() + 20
        while any(port_open(x) for x in ports) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(port_open(x) for x in ports), f"servers outlived the killed driver ({what})"
    # 3) resume to the end
    if p.poll() is None or p.returncode != 0:
        p = start(root, log)
        assert p.wait(timeout=900) == 0, log.read_text()[-3000:]
    check_ledger(run)


def check_ledger(run: Path) -> None:
    lines = read_ledger(run / "rollouts.jsonl")
    accepted = [ln for ln in lines if ln["verdict"] == "accepted"]
    assert collections.Counter(ln["step"] for ln in accepted) == {s: B for s in range(STEPS)}  # B groups a step
    keys = [(ln["epoch"], ln["index"]) for ln in lines]
    assert len(keys) == len(set(keys)), "an episode has two ledger lines (regenerated or trained twice)"
    for ln in accepted:  # staleness bound: trained at version `step`, head version >= step - eta
        assert ln["step"] - ln["head_version"] <= ETA and ln["versions"][0] >= ln["head_version"]
    final = latest_checkpoint(run)
    assert final is not None and final.name == f"step_{STEPS - 1:08d}"
    meta = json.loads((final / "trainer.json").read_text())
    state = torch.load(final / "rollout.pt", weights_only=True)
    pending = [(e["tag"]["epoch"], e["tag"]["index"]) for e in state["executor"]["episodes"]]
    # episodes that finished after the final checkpoint's snapshot (while the run shut down) are in the
    # ledger past the size it recorded; up to it, ledger + snapshot must account for every drawn index
    head = (run / "rollouts.jsonl").read_bytes()[:meta["ledger_bytes"]].decode().splitlines()
    keys = [(ln["epoch"], ln["index"]) for ln in map(json.loads, head)]
    loader = state["loader"]
    assert loader["epoch"] == 0
    order = EpochLoader(list(range(loader["size"])), seed=loader["seed"])._permutation(0)
    drawn = {(0, i) for i in order[:loader["position"]]}
    assert set(keys) | set(pending) == drawn and not set(keys) & set(pending)  # each drawn index exactly once
    assert meta["version"] == STEPS and (run / "final_hf" / "config.json").exists()
