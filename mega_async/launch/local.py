"""Starting the trainer ranks of a run: on one host `mega-async train` spawns them itself (torchrun);
under torchrun or srun (many hosts) every rank runs the same command unchanged.

A failure on any rank stops all ranks (torchrun stops the others; servers die with rank 0) and the
command exits non-zero with the first failing rank's error in one line ("trainer rank 1 was killed by
SIGKILL" when a signal ended it). Whatever ends the command ends its whole tree within about a second:
torchrun has a parent-death signal and every rank watches the command (mega_async.utils.lifeline). A rank stopped
(SIGSTOP, a frozen cgroup) for RANK_STOPPED_S ends the run with a line naming it, instead of its peers waiting in a
collective for torch's 30-minute timeout without a word.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from mega_async.utils import lifeline

ERROR_DIR_ENV = lifeline.ERROR_DIR_ENV
RUN_LOCK_ENV = "MEGA_ASYNC_RUN_LOCKED"  # the run directory whose lock the launching command holds for the ranks
PREEMPT_SIGNAL = signal.SIGUSR1  # "checkpoint at the next step boundary and stop" (Slurm's --signal)
_HARD = ("SIGKILL", "SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL", "SIGFPE")  # never torchrun's own way of stopping


def under_launcher() -> bool:
    """True when this process is one rank of a multi-rank launch (torchrun, or srun with several tasks)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    return "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class LauncherSignal(KeyboardInterrupt):
    """SIGTERM or SIGHUP to the launching command: stop the ranks as Ctrl-C does, and say which signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def stop_signals() -> list[int]:
    """SIGTERM, and SIGHUP unless it is ignored (`nohup`): what asks this command to stop besides Ctrl-C."""
    sigs = [signal.SIGTERM]
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        sigs.append(signal.SIGHUP)
    return sigs


def why_stopped(signum: int) -> str:
    """In words, for the one line the command ends with."""
    if signum == getattr(signal, "SIGHUP", None):
        return "stopped by SIGHUP (its terminal or ssh session closed)"
    return f"stopped by {signal_name(signum)} (sent by a scheduler, `kill` or the system)"


def launch_local(nproc: int, argv: Sequence[str], run_lock: Any = None,
                 resume_hint: Callable[[], str] = lambda: "") -> int:
    """Run `mega-async <argv>` as `nproc` ranks on this host; returns the exit code (prints one error line, ended by
    `resume_hint()`). `run_lock` (mega_async.run.lock.RunDirLock): torchrun's agent holds it too, so the run
    directory stays locked until the agent, which outlives its ranks, has ended."""
    from mega_async.utils.comm import free_port

    err_dir = tempfile.mkdtemp(prefix="mega_async_ranks_")
    cmd = [sys.executable, "-m", "mega_async.launch.agent", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", "mega_async.cli", *argv]
    env = {**os.environ, ERROR_DIR_ENV: err_dir, lifeline.LAUNCHER_ENV: str(lifeline.ProcessRef.of(os.getpid()))}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (2 * nproc))))
    if run_lock is not None:
        env[RUN_LOCK_ENV] = str(run_lock.run_dir)
    # its own session, so a signal to this command (Ctrl-C, a scheduler's SIGTERM) is forwarded once and the whole
    # tree can be killed if it does not stop in time; SIGTERM to it when this command dies, however it dies
    proc = subprocess.Popen(cmd, env=env, preexec_fn=lifeline.child_preexec(signal.SIGTERM, parent=os.getpid()),
                            pass_fds=(run_lock.fd,) if run_lock is not None else ())
    handlers = {s: signal.signal(s, _interrupt) for s in stop_signals()}  # before: a signal kills us, torchrun follows
    previous_usr1 = signal.signal(PREEMPT_SIGNAL, lambda signum, frame: forward_to_ranks(proc.pid, signum))
    try:
        try:
            rc = _wait_watching(proc)
        except RankStopped as e:
            _stop(proc, grace=10.0)
            _say(f"mega-async train: {e}; every rank and server was stopped{resume_hint()}")
            return 1
        except KeyboardInterrupt as e:
            _stop(proc)
            if isinstance(e, LauncherSignal):
                _say(f"mega-async train: {why_stopped(e.signum)}; every rank and server was stopped{resume_hint()}")
                return 128 + e.signum
            _say(f"mega-async train: interrupted; every rank and server was stopped{resume_hint()}")
            return 130
        if rc != 0:
            _say(f"mega-async train: {failure_line(err_dir, rc)}{resume_hint() if _ranks_ran(err_dir) else ''}")
        return rc
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        signal.signal(PREEMPT_SIGNAL, previous_usr1)
        shutil.rmtree(err_dir, ignore_errors=True)


def _say(line: str) -> None:
    with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
        print(line, file=sys.stderr, flush=True)


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
        self.at: Optional[float] = None  # time.monotonic() when the signal came (the deadline counts from it)
        signal.signal(PREEMPT_SIGNAL, self._set)

    def _set(self, signum: int, frame: object) -> None:
        if not self.requested:
            self.at = time.monotonic()
        self.requested = True

    def __call__(self) -> bool:
        return self.requested


def _interrupt(signum: int, frame: Any) -> None:
    if not _redelivered_from_finalizer(signum, frame):
        raise LauncherSignal(signum)  # a SIGTERM/SIGHUP to this command stops the ranks as Ctrl-C does


RANK_STOPPED_S = 30.0  # a trainer rank stopped (state T) this long holds every other rank in a collective: the run ends


class RankStopped(RuntimeError):
    """A trainer rank is stopped (SIGSTOP or frozen) and every other rank waits for it."""


def _wait_watching(proc: subprocess.Popen, stopped_for: float = RANK_STOPPED_S) -> int:
    """proc.wait(), and meanwhile: a trainer rank that stays stopped `stopped_for` seconds (its peers would wait in
    a collective for torch's 30-minute timeout, saying nothing) raises RankStopped naming it (it is continued first,
    so the stop that follows can end it)."""
    since: dict[int, float] = {}
    while True:
        try:
            return proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        stopped = dict((pid, rank) for rank, pid in lifeline.stopped_ranks(proc.pid))
        since = {pid: since.get(pid, now) for pid in stopped}
        late = sorted((stopped[pid], pid, now - t0) for pid, t0 in since.items() if now - t0 >= stopped_for)
        if late:
            for _, pid, _ in late:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            rank, pid, waited = late[0]
            raise RankStopped(f"trainer rank {rank} (pid {pid}) has been stopped (SIGSTOP or frozen) for "
                              f"{waited:.0f} s while the other ranks wait for it; find what stopped it")


def _stop(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGINT to torchrun (it stops every rank; they stop their servers), then SIGKILL after `grace` (the ranks,
    watching torchrun and this command, then end themselves)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=grace)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---- why the ranks failed, in one line ------------------------------------------------------------------------
def first_error(err_dir: str) -> Optional[str]:
    """The earliest error line a rank wrote (None: no rank wrote one)."""
    found = _notes(err_dir, "txt")
    return found[0][2] if found else None


def _notes(err_dir: str, ext: str) -> list[tuple[float, int, str]]:
    """(mtime, rank, text) of every non-empty rank<R>.<ext>, oldest first."""
    out = []
    for f in Path(err_dir).glob(f"rank*.{ext}"):
        with contextlib.suppress(OSError, ValueError):
            text = f.read_text().strip()
            if text:
                out.append((f.stat().st_mtime, int(f.stem[4:]), text))
    return sorted(out)


def _failures(err_dir: str) -> list[dict]:
    with contextlib.suppress(OSError, ValueError):
        from mega_async.launch.agent import FAILURES

        records = json.loads((Path(err_dir) / FAILURES).read_text())
        return sorted(records, key=lambda r: r["time"]) if isinstance(records, list) else []  # stable: seen order
    return []


def _ranks_ran(err_dir: str) -> bool:
    return bool(_failures(err_dir) or _notes(err_dir, "txt") or _notes(err_dir, "stopped"))


def failure_line(err_dir: str, rc: int) -> str:
    """What ended the ranks: a rank killed by a hard signal at the first failure (the other ranks' errors are its
    consequence: a peer gone), else the first failing rank's own error line, else a rank stopped from outside,
    else the first failing rank's exit code or signal, else torchrun's own end."""
    records = _failures(err_dir)
    errors = {rank: text for _, rank, text in reversed(_notes(err_dir, "txt"))}
    first = [r for r in records if r["time"] <= records[0]["time"] + 1] if records else []
    for r in first:
        if r.get("signal") in _HARD:
            return f"trainer rank {r['rank']} was killed by {r['signal']} (pid {r['pid']})"
    for r in first:
        if r["rank"] in errors:
            return errors[r["rank"]]
    if errors:
        return first_error(err_dir) or ""
    stops = _notes(err_dir, "stopped")
    if stops:
        return stops[0][2]
    if records:
        r = records[0]
        how = f"was killed by {r['signal']}" if r.get("signal") else f"exited with code {r['exitcode']}"
        return f"trainer rank {r['rank']} {how} (pid {r['pid']}) without an error message; see the log above"
    if rc < 0:
        return f"the rank launcher (torchrun) was killed by {signal_name(-rc)}"
    return f"the rank launcher (torchrun) exited with code {rc}; see the log above"


# ---- in a rank ------------------------------------------------------------------------------------------------
class StoppedByLauncher(SystemExit):
    """SIGTERM (or SIGHUP) to this rank: from torchrun stopping the other ranks after one failed, from a
    scheduler, or from `kill`. Raised as SystemExit so `finally` blocks run (servers stop)."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return why_stopped(self.signum)


def stopped_by_launcher(exc: BaseException) -> bool:
    return isinstance(exc, StoppedByLauncher)


def _rank() -> str:
    return os.environ.get("RANK", "0")


def record_error(exc: BaseException) -> str:
    """A rank's error as one line; written for the launching command to print, and returned."""
    msg = " ".join(str(exc).split())
    line = f"rank {_rank()}: {type(exc).__name__}{': ' + msg if msg else ''}"
    _write_note("txt", line)
    return line


def record_stop(exc: StoppedByLauncher) -> str:
    """A rank stopped by a signal: the launching command names it when no rank failed on its own."""
    line = f"trainer rank {_rank()} was {exc} and stopped the run"
    _write_note("stopped", line)
    return line


def _write_note(ext: str, line: str) -> None:
    d = os.environ.get(ERROR_DIR_ENV)
    if d:
        with contextlib.suppress(OSError), open(Path(d) / f"rank{_rank()}.{ext}", "w") as f:
            f.write(line + "\n")


def _in_finalizer(frame: Any) -> bool:
    """The signal arrived inside a finalizer (an object's __del__, a weakref callback): an exception raised there
    is printed as "Exception ignored" and lost, and the run would go on as if nothing had been asked."""
    depth = 0
    while frame is not None and depth < 64:
        code = frame.f_code
        if code.co_name == "__del__" or code.co_filename.endswith(("weakref.py", "_weakrefset.py")):
            return True
        frame, depth = frame.f_back, depth + 1
    return False


def _redelivered_from_finalizer(signum: int, frame: Any) -> bool:
    """A stop signal that landed in a finalizer is sent again 50 ms later (raised there it would be lost); True then."""
    if not _in_finalizer(frame):
        return False
    threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()
    return True


def stop_on_sigterm() -> None:
    """SIGTERM (torchrun stopping the other ranks, a scheduler) and SIGHUP (a closed terminal) raise
    StoppedByLauncher, so `finally` blocks run (servers stop). A signal that lands in a finalizer (where the
    exception would be swallowed: a SIGHUP once left a run training on) is delivered again 50 ms later."""
    def handler(signum: int, frame: Any) -> None:
        if not _redelivered_from_finalizer(signum, frame):
            raise StoppedByLauncher(signum)

    for s in stop_signals():
        signal.signal(s, handler)
