"""Starting the trainer ranks of a run: on one host `mega-async train` spawns them itself (torchrun);
under torchrun or srun (many hosts) every rank runs the same command unchanged.

A failure on any rank stops all ranks (torchrun stops the others; servers die with rank 0) and the
command exits non-zero with the first failing rank's error in one line.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

ERROR_DIR_ENV = "MEGA_ASYNC_ERROR_DIR"


def under_launcher() -> bool:
    """True when this process is one rank of a multi-rank launch (torchrun, or srun with several tasks)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def launch_local(nproc: int, argv: Sequence[str]) -> int:
    """Run `mega-async <argv>` as `nproc` ranks on this host; returns the exit code (prints one error line)."""
    from mega_async.comm import free_port

    err_dir = tempfile.mkdtemp(prefix="mega_async_ranks_")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "mega_async.cli", *argv]
    env = {**os.environ, ERROR_DIR_ENV: err_dir}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (2 * nproc))))
    # its own session, so a signal to this command (Ctrl-C, a scheduler's SIGTERM) is forwarded once and
    # the whole tree can be killed if it does not stop in time
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    previous_usr1 = signal.signal(PREEMPT_SIGNAL, lambda signum, frame: forward_to_ranks(proc.pid, signum))
    try:
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            _stop(proc)
            print("mega-async train: interrupted", file=sys.stderr)
            return 130
        if rc != 0:
            line = first_error(err_dir)
            print(f"mega-async train: {line or f'a trainer rank failed (torchrun exit code {rc}); see the log above'}",
                  file=sys.stderr)
        return rc
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(PREEMPT_SIGNAL, previous_usr1)
        shutil.rmtree(err_dir, ignore_errors=True)


PREEMPT_SIGNAL = signal.SIGUSR1  # "checkpoint at the next step boundary and stop" (Slurm's --signal)


def forward_to_ranks(launcher_pid: int, signum: int) -> None:
    """Send `signum` to torchrun's worker processes (not to torchrun itself, which would die of SIGUSR1)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        agent = psutil.Process(launcher_pid)
        for child in agent.children(recursive=False):
            with contextlib.suppress(psutil.Error):
                child.send_signal(signum)


class PreemptFlag:
    """Set by PREEMPT_SIGNAL in a trainer rank; the driver checkpoints and stops at the next step boundary."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(PREEMPT_SIGNAL, self._set)

    def _set(self, signum: int, frame: object) -> None:
        self.requested = True

    def __call__(self) -> bool:
        return self.requested


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # a SIGTERM to this command stops the ranks as Ctrl-C does


def _stop(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGINT to every rank (they stop their servers), then SIGKILL to the whole tree after `grace`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=grace)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def first_error(err_dir: str) -> Optional[str]:
    files = sorted(Path(err_dir).glob("rank*.txt"), key=lambda p: p.stat().st_mtime)
    for f in files:
        text = f.read_text().strip()
        if text:
            return text
    return None


class StoppedByLauncher(SystemExit):
    """SIGTERM from torchrun (stopping the other ranks after one failed) or from a scheduler."""


def stopped_by_launcher(exc: BaseException) -> bool:
    return isinstance(exc, StoppedByLauncher)


def record_error(exc: BaseException) -> str:
    """A rank's error as one line; written for the launching command to print, and returned."""
    rank = os.environ.get("RANK", "0")
    msg = " ".join(str(exc).split())
    line = f"rank {rank}: {type(exc).__name__}{': ' + msg if msg else ''}"
    d = os.environ.get(ERROR_DIR_ENV)
    if d:
        with open(Path(d) / f"rank{rank}.txt", "w") as f:
            f.write(line + "\n")
    return line


def stop_on_sigterm() -> None:
    """torchrun stops the other ranks with SIGTERM: raise SystemExit so `finally` blocks run (servers stop)."""
    def handler(signum: int, frame: object) -> None:
        raise StoppedByLauncher(128 + signum)

    signal.signal(signal.SIGTERM, handler)
