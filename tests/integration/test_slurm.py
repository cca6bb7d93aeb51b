"""A real single-node Slurm (.ci/slurm_up.sh: Debian's slurm-wlm + munge, slurmctld + slurmd on this host):
the tiny CPU GSM8K job goes through `mega-async launch slurm` and sbatch exactly as on a cluster (embedded
server, gloo; the differences come from the config). It completes with metrics and eval metrics written;
a job whose server is killed ends its allocation with the component named in the driver's log; Slurm's
pre-emption signal and scancel end the job with nothing left running. Nothing is mocked."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mega_async.bridge.model_cards import TINY_MOE, init_random_weights

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm():
    r = subprocess.run(["bash", str(ROOT / ".ci" / "slurm_up.sh")], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return init_random_weights(TINY_MOE, tmp_path_factory.mktemp("slurm") / "moe", seed=3)


@pytest.fixture
def jobs():
    """Job ids submitted by a test; any still queued or running afterwards (a failed test) is cancelled."""
    submitted: list[str] = []
    yield submitted
    for job in submitted:
        if job_state(job)[0] in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"):
            subprocess.run(["scancel", job])


def launch(tmp: Path, model: Path, *overrides: str, jobs: list | None = None, flags=(), slots: int = 2) -> tuple[str, Path]:
    cmd = [sys.executable, "-m", "mega_async.cli", "launch", "slurm", "-c", str(ROOT / "configs" / "gsm8k_tiny_cpu.yaml"),
           "--nodes", "1", "--gpus-per-node", str(slots), "--time", "30", *flags, f"logging.root_dir={tmp / 'runs'}",
           f"model.path={model}", *overrides]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    job = r.stdout.split("submitted job ")[1].split(":")[0]
    if jobs is not None:
        jobs.append(job)
    return job, tmp / "runs" / "gsm8k_tiny_cpu" / "run0"


def job_state(job: str) -> tuple[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return fields.get("JobState", "?"), fields.get("ExitCode", "?")


def wait_done(job: str, timeout: float = 600) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state, code = job_state(job)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"):
            return state, code
        time.sleep(2)
    subprocess.run(["scancel", job])
    pytest.fail(f"job {job} still {job_state(job)} after {timeout}s")


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(1)
    pytest.fail(f"timed out waiting for {what}")


def leftovers(tmp: Path) -> list[str]:
    me = os.getpid()
    return [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["pid", "cmdline"])
            if p.info["pid"] != me and str(tmp) in " ".join(p.info["cmdline"] or [])]


def server_procs(tmp: Path) -> list[psutil.Process]:
    """The embedded server processes of this test's job (not the srun steps that started them)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd[1:3] == ["-m", "mega_async.server"] and str(tmp) in " ".join(cmd):
            out.append(p)
    return out


def steps(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def test_tiny_gsm8k_job_completes_with_metrics(slurm, model, tmp_path, jobs):
    job, run = launch(tmp_path, model, jobs=jobs)
    state, code = wait_done(job)
    logs = run / "logs"
    assert (state, code) == ("COMPLETED", "0:0"), (logs / "job.log").read_text() + (logs / "driver.log").read_text()[-3000:]
    s = steps(run)
    assert [x["version"] for x in s] == [1, 2]
    assert all(x["eval/problems"] == 4 and 0 <= x["eval/pass@1"] <= 1 and x["train/tokens"] > 0 for x in s)
    assert (run / "final_hf" / "config.json").exists()
    for name in ("job.log", "driver.log", "server0.log", f"slurm-{job}.out"):
        assert (logs / name).stat().st_size > 0, name
    assert "training finished" in (logs / "job.log").read_text()
    assert "mega_async.server" in (logs / "server0.log").read_text()
    assert not leftovers(tmp_path)


def test_a_killed_server_ends_the_allocation(slurm, model, tmp_path, jobs):
    job, run = launch(tmp_path, model, "trainer.total_steps=500", jobs=jobs)
    wait_for(lambda: len(steps(run)) >= 1, 400, "the first training step")
    procs = server_procs(tmp_path)
    assert len(procs) == 1
    procs[0].send_signal(signal.SIGKILL)
    state, code = wait_done(job, 300)
    assert state == "FAILED" and code != "0:0"
    driver = (run / "logs" / "driver.log").read_text()
    assert "mega-async launch: component server0 on" in driver and "exited with code" in driver
    assert "job failed: server0" in (run / "logs" / "job.log").read_text()
    wait_for(lambda: not leftovers(tmp_path), 60, "every process of the job to end")
    assert len(steps(run)) < 500


@pytest.mark.parametrize("how", ["preempt", "scancel"])
def test_preemption_signal_and_scancel_end_everything(slurm, model, tmp_path, jobs, how):
    job, run = launch(tmp_path, model, "trainer.total_steps=500", jobs=jobs)
    wait_for(lambda: len(steps(run)) >= 1, 400, "the first training step")
    if how == "preempt":  # what --signal=B:USR1@<s> delivers before the time limit
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    else:
        subprocess.run(["scancel", job], check=True)
    state, _ = wait_done(job, 300)
    assert state in ("COMPLETED", "FAILED", "CANCELLED")
    wait_for(lambda: not leftovers(tmp_path), 90, "every process of the job to end")
    log = (run / "logs" / "job.log").read_text()
    out = (run / "logs" / f"slurm-{job}.out").read_text()
    assert "unbound variable" not in out and "syntax error" not in out, out[-2000:]  # the script itself held up
    if how == "preempt":
        assert "pre-emption signal (SIGUSR1)" in log
        # the supervisor saw the driver stop and said how (checkpointed, or its exit code and last error)
        assert "pre-empted: driver checkpointed" in log or "trainer exited with code" in log, log
        assert len(steps(run)) < 500
    else:
        assert "SIGTERM/SIGINT: stopping every component" in log


@pytest.mark.timeout(2400)  # two runs of the job on the real engine (and Slurm's hold, should the release fail)
def test_the_gpu_recipes_branch_runs_on_real_sglang_and_requeues_losslessly(slurm, model, tmp_path, jobs):
    """The job the GPU recipes render (inference.backend=sglang), on this machine's CPUs (launch.device=cpu): the
    job starts a real SGLang 0.5.23 server (its CPU engine, the command built as a local run builds it) and smg in
    front of it; the trainer (two ranks) generates through smg, with routing replay (R3: the server returns every
    token's experts, the trainer replays them), and checkpoints by the clock (trainer.save_every_minutes). Then
    SIGUSR1: the driver checkpoints and exits 0, the job requeues itself and its second run continues from that
    checkpoint (trainer.resume=auto) to the end: every step once, every version in order, nothing left running."""
    venv = os.environ.get("SGLANG_CPU_VENV")
    assert venv and (Path(venv) / "bin" / "smg").exists(), \
        "SGLANG_CPU_VENV must name the engine's environment with smg (bash tools/install_sglang_cpu.sh; .ci/run does)"
    job, run = launch(tmp_path, model, "trainer.total_steps=6", "inference.backend=sglang", "launch.device=cpu",
                      "launch.startup_timeout=600", "parallel.allocation=sglang:d1+megatron:d2",
                      "algorithm.routing_replay=true", "inference.router=smg",
                      f"inference.router_bin={Path(venv) / 'bin' / 'smg'}", "trainer.save_every_minutes=0.001",
                      jobs=jobs, flags=["--requeue"], slots=3)
    wait_for(lambda: len(steps(run)) >= 2, 900, "two training steps")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    wait_for(lambda: "requeueing job" in (run / "logs" / "job.log").read_text(), 300, "the requeue")
    wait_for(lambda: job_state(job)[0] == "PENDING", 300, "the requeued job to be pending")
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+3"], capture_output=True, check=False)
    wait_for(lambda: "(restart 1)" in (run / "logs" / "job.log").read_text(), 300, "the requeued run to start")
    state, code = wait_done(job, 1200)
    logs = run / "logs"
    log = (logs / "job.log").read_text()
    assert (state, code) == ("COMPLETED", "0:0"), log + (logs / "driver.log").read_text()[-3000:]
    driver = (logs / "driver.log").read_text()
    assert "preempted" in driver
    s = steps(run)
    assert [x["step"] for x in s] == list(range(6)), [x["step"] for x in s]  # resumed, nothing repeated or lost
    assert [x["version"] for x in s] == list(range(1, 7))
    assert "training finished" in log.split("(restart 1)")[1]
    server = (logs / "server0.log").read_text()  # the real engine, as the recipes start it, routes on
    assert "sglang.launch_server" in server and "--device cpu" in server and "--enable-return-routed-experts" in server
    assert "smg at " in log and (logs / "router.log").exists()
    # generation through smg (never around it); the trainer replayed the engine's routes on every token it can
    # compare (those the current weights generated: a step's batch is partly older, and the resumed run's first
    # batch is the checkpoint's)
    assert all(x["router/around"] == 0 for x in s) and sum(x["router/answers"] for x in s) > 0, s
    current = [x for x in s if x["train/mismatch/current_tokens"] > 0]
    assert current and all(x["train/mismatch/route_top1_frac"] == 0 for x in current), s
    import re

    train_log = (run / "train.log").read_text()
    first = train_log.split("preempted")[0]
    saved = set(re.findall(r"checkpoint \S*step_(\d+)", first))
    assert len(saved) >= 2, first[-3000:]  # by the clock, after each step before the signal (save_interval 0)
    assert (run / "final_hf" / "config.json").exists()
    wait_for(lambda: not leftovers(tmp_path), 90, "every process of the job to end")


