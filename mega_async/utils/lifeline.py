"""Every process of a run ends when the process that started it ends, however that one ends (`kill -9`
included, which no signal handler sees).

Three ties, each for what the others cannot reach:
- a child we start ourselves gets PR_SET_PDEATHSIG (`child_preexec`): the kernel signals it when its parent
  thread dies (torchrun from the launcher; the servers from the driver);
- a process started by someone else (a trainer rank under torchrun) watches the processes it must not outlive
  (`watch`: the launching `mega-async train`, its own parent): a daemon thread polls them every 0.25 s and,
  once one is gone, SIGKILLs this process's descendants and this process;
- Megatron's checkpoint writer keeps a spawned multiprocessing manager we cannot pass a preexec to: it is
  started with an initializer that runs the same watch on its parent (`guard_checkpoint_writer`).
A process is named by pid and start time (`ProcessRef`), so a reused pid is never mistaken for it.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

logger = logging.getLogger("mega_async.utils.lifeline")

ERROR_DIR_ENV = "MEGA_ASYNC_ERROR_DIR"  # where each rank of a local launch writes its one-line error
LAUNCHER_ENV = "MEGA_ASYNC_LAUNCHER"  # "<pid>:<start>" of the `mega-async train` that started torchrun
POLL_S = 0.25
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcessRef:
    """A process as pid plus start time (clock ticks after boot): stays false once it ended, pid reuse or not."""

    pid: int
    start: Optional[int]

    @classmethod
    def of(cls, pid: int) -> "ProcessRef":
        return cls(pid, _start_time(pid))

    @classmethod
    def parse(cls, text: str) -> Optional["ProcessRef"]:
        try:
            pid, start = text.split(":")
            return cls(int(pid), int(start) if start else None)
        except ValueError:
            return None

    def __str__(self) -> str:
        return f"{self.pid}:{'' if self.start is None else self.start}"

    def alive(self) -> bool:
        """Running (a zombie, ended but not yet reaped by its parent, counts as ended)."""
        stat = _stat(self.pid)
        if stat is None:
            if sys.platform.startswith("linux"):
                return False
            try:  # no /proc: existence only
                os.kill(self.pid, 0)
                return True
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
        state, start = stat
        return state not in ("Z", "X", "x") and (self.start is None or start == self.start)


def _stat(pid: int) -> Optional[tuple[str, int]]:
    """(state, start time) from /proc/<pid>/stat, None when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) ": the name may hold spaces and brackets
    return fields[0], int(fields[19])


def _start_time(pid: int) -> Optional[int]:
    stat = _stat(pid)
    return stat[1] if stat else None


def stopped_ranks(root: int) -> list[tuple[int, int]]:
    """The trainer ranks under process `root` (processes with RANK in their environment) that are stopped (state T:
    SIGSTOP, a debugger, a frozen cgroup), as (rank, pid); [] where /proc cannot tell."""
    children: dict[int, list[int]] = {}
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
            children.setdefault(int(raw[raw.rindex(")") + 2:].split()[1]), []).append(pid)
        except (OSError, ValueError, IndexError):
            continue
    out, todo, seen = [], list(children.get(root, [])), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(children.get(pid, []))
        stat = _stat(pid)
        if stat is None or stat[0] not in ("T", "t"):
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env and env[b"RANK"].isdigit():
            out.append((int(env[b"RANK"]), pid))
    return sorted(out)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """PR_SET_PDEATHSIG for this process: `sig` when the thread that forked it ends (Linux; False elsewhere)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def child_preexec(sig: int = signal.SIGTERM, new_session: bool = True,
                  parent: Optional[int] = None) -> Callable[[], None]:
    """A Popen preexec_fn: its own session (a signal to our group is not delivered twice), `sig` when the parent
    thread dies, and exit at once when the parent (pid `parent`) already died before the tie was made."""
    def preexec() -> None:
        if new_session:
            os.setsid()
        set_parent_death_signal(sig)
        if parent is not None and os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(1)
    return preexec


def end_tree(reason: str, quiet: bool = False) -> None:
    """SIGKILL every descendant of this process (a descendant that leads its own process group, e.g. a server,
    with its group), then this process. Nothing graceful: what started us is gone."""
    if not quiet:
        with contextlib.suppress(OSError):
            os.write(2, f"mega-async: {reason}: ending process {os.getpid()} and everything it started\n".encode())
    try:
        import psutil

        kids = psutil.Process().children(recursive=True)
    except Exception:  # noqa: BLE001 - no psutil or /proc: the kernel ties (PDEATHSIG) still end the children
        kids = []
    for k in kids:
        with contextlib.suppress(Exception):
            if os.getpgid(k.pid) == k.pid:
                os.killpg(k.pid, signal.SIGKILL)
            else:
                os.kill(k.pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def watch(refs: Sequence[ProcessRef], parent: Optional[int] = None, what: str = "the launcher",
          on_loss: Callable[[str], None] = end_tree, interval: float = POLL_S) -> threading.Thread:
    """A daemon thread: once any of `refs` ends, or this process's parent is no longer `parent` (it died and we
    were handed to init), `on_loss(reason)`, by default `end_tree`."""
    def loop() -> None:
        while True:
            for r in refs:
                if not r.alive():
                    return on_loss(f"{what} (pid {r.pid}) is gone")
            if parent is not None and os.getppid() != parent:
                return on_loss(f"its parent process (pid {parent}) is gone")
            time.sleep(interval)

    t = threading.Thread(target=loop, name="lifeline", daemon=True)
    t.start()
    return t


def watch_launcher() -> Optional[threading.Thread]:
    """In a trainer rank under torchrun or srun: end with the `mega-async train` that started the ranks (when it
    says who it is in MEGA_ASYNC_LAUNCHER) and with this rank's parent (torchrun's agent, or srun's step daemon)."""
    refs = []
    launcher = ProcessRef.parse(os.environ.get(LAUNCHER_ENV, ""))
    if launcher is not None:
        if not launcher.alive():
            end_tree(f"the launcher (pid {launcher.pid}) is gone")
        refs.append(launcher)
    ppid = os.getppid()
    return watch(refs, parent=ppid if ppid > 1 else None)


# ---- Megatron's checkpoint writer -------------------------------------------------------------------------
def _watch_parent_from_child(parent: ProcessRef) -> None:
    """Initializer of the manager process: it ends (with anything it started) when `parent` ends. A spawned process
    starts with every signal's default action, and Slurm delivers the pre-emption signal (SIGUSR1, "checkpoint and
    stop") to every process of the trainer's step: by default it would end this one, and with it the checkpoint
    the driver is writing or about to write for that very signal (BrokenPipeError in Megatron's writer). It
    ignores it; the trainer rank it serves handles it."""
    if not parent.alive() or os.getppid() != parent.pid:
        os._exit(1)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a forked one has the rank's handlers: a spawned one's defaults
        signal.signal(sig, signal.SIG_DFL)
    watch([parent], parent=parent.pid, on_loss=_end_quietly)


def _end_quietly(reason: str) -> None:
    end_tree(reason, quiet=True)


def guard_checkpoint_writer() -> None:
    """Megatron's `torch_dist` writer collects its results through a spawned multiprocessing manager that it
    starts on the first save and keeps (about 275 MB); nothing ends it when this process is SIGKILLed, and with
    it stays multiprocessing's resource tracker. Start that manager ourselves, from this (main) thread, with an
    initializer that watches this process, before Megatron would. Idempotent; a no-op if Megatron changed.

    Megatron starts it with "spawn" (no CUDA state copied into it); without CUDA it is forked: a spawned one is a
    fresh interpreter that re-imports the rank's main module (torch, Megatron), about 4 CPU-seconds a rank a run
    for a process that only relays a queue."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa
    except ImportError:
        return
    if getattr(fsa, "_results_queue", "absent") is not None:
        return  # already started (by us or by Megatron), or a Megatron without it
    from multiprocessing.managers import SyncManager

    import torch
    import torch.multiprocessing as mp

    manager = SyncManager(ctx=mp.get_context("spawn" if torch.cuda.is_available() else "fork"))
    manager.start(initializer=_watch_parent_from_child, initargs=(ProcessRef.of(os.getpid()),))
    fsa._results_queue = manager.Queue()  # the proxy keeps the manager (shut down at exit as Megatron's was)
    logger.debug("checkpoint writer's result manager: pid %s, ends with this process", manager._process.pid)
