"""Processes of a run end with the process that started them, however it ends (mega_async/utils/lifeline.py):
a process is known by pid and start time; a watcher ends its whole tree once what it watches is gone; a child
started with `child_preexec` dies with its parent; Megatron's checkpoint-writer manager (and multiprocessing's
resource tracker with it) ends with the process that saved, under kill -9 too."""
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from mega_async.utils.lifeline import ProcessRef

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _gone(pids, timeout: float) -> float:
    """Seconds until every pid has ended (a zombie counts as ended); fails after `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not any(ProcessRef.of(p).alive() for p in pids):
            return time.monotonic() - t0
        time.sleep(0.05)
    alive = [" ".join(psutil.Process(p).cmdline()) for p in pids if ProcessRef.of(p).alive()]
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise AssertionError(f"still running after {timeout}s: {alive}")


def _python(code: str, *args: str, stdin=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=ENV,
                            stdin=stdin)


def test_a_process_is_its_pid_and_start_time():
    p = subprocess.Popen(["sleep", "30"])
    ref = ProcessRef.of(p.pid)
    assert ref.alive() and ProcessRef.parse(str(ref)) == ref
    assert not ProcessRef(p.pid, ref.start + 1).alive()  # the same pid, another process
    p.kill()
    time.sleep(0.2)
    assert not ref.alive()  # a zombie (not yet waited for) has ended
    p.wait()
    assert not ref.alive() and ProcessRef.parse("nonsense") is None


WATCHER = """
import subprocess, sys, time
from mega_async.utils.lifeline import ProcessRef, watch
watch([ProcessRef.of(int(sys.argv[1]))])
kids = [subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"], start_new_session=True)]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(60)
"""


def test_a_watcher_ends_its_tree_when_the_watched_process_dies():
    launcher = subprocess.Popen(["sleep", "60"])
    w = _python(WATCHER, str(launcher.pid))
    kids = [int(x) for x in w.stdout.readline().split()]
    launcher.kill()
    launcher.wait()
    assert _gone([w.pid, *kids], 5) < 5
    w.wait()


ORPHAN = """
import os, subprocess, sys, time
from mega_async.utils.lifeline import watch
code = "import os, sys, time; from mega_async.utils.lifeline import watch; watch([], parent=os.getppid()); " \\
       "print(os.getpid(), flush=True); time.sleep(60)"
child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
time.sleep(60)
"""


def test_a_rank_ends_when_its_parent_is_killed():
    agent = _python(ORPHAN)  # stands for torchrun's agent, the rank for its child
    rank = int(agent.stdout.readline())
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    assert _gone([rank], 5) < 5


PREEXEC = """
import signal, subprocess, time
from mega_async.utils.lifeline import child_preexec
p = subprocess.Popen(["sleep", "60"], preexec_fn=child_preexec(signal.SIGKILL))
print(p.pid, flush=True)
time.sleep(60)
"""


def test_a_child_started_with_the_preexec_dies_with_its_parent():
    parent = _python(PREEXEC)
    child = int(parent.stdout.readline())
    assert os.getpgid(child) == child  # its own session: a signal to the parent's group is not delivered twice
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert _gone([child], 5) < 1


GUARD = """
import os, time
import psutil
from mega_async.utils.lifeline import guard_checkpoint_writer
from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa
guard_checkpoint_writer()
guard_checkpoint_writer()  # once
q = fsa._get_write_results_queue()  # what Megatron's writer asks for: ours
q.put(1)
assert q.get() == 1
print(" ".join(str(c.pid) for c in psutil.Process().children()), flush=True)
time.sleep(120)
"""


def test_megatrons_checkpoint_writer_ends_with_a_killed_driver():
    driver = _python(GUARD)
    kids = [int(x) for x in driver.stdout.readline().split()]
    cmds = [" ".join(psutil.Process(k).cmdline()) for k in kids]
    if torch.cuda.is_available():  # Megatron's way: spawned, with multiprocessing's resource tracker
        assert len(kids) == 2 and any("resource_tracker" in c for c in cmds) and any("spawn_main" in c for c in cmds)
    else:  # forked: no second interpreter importing torch and Megatron (about 4 CPU-s a rank a run)
        assert len(kids) == 1 and not any("spawn_main" in c for c in cmds), cmds
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    took = _gone(kids, 10)
    assert took < 3, took


PREEMPTED = """
import signal, sys
from mega_async.utils.lifeline import guard_checkpoint_writer
from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa
signal.signal(signal.SIGUSR1, lambda *a: None)  # the trainer rank's PreemptFlag
guard_checkpoint_writer()
q = fsa._get_write_results_queue()
print(fsa._results_queue._manager._process.pid, flush=True)
sys.stdin.readline()  # the test sent SIGUSR1 to the manager meanwhile
q.put(2)
print(q.get(), flush=True)
"""


def test_the_checkpoint_writers_manager_outlives_the_preemption_signal():
    """Slurm signals every process of the trainer's step with SIGUSR1 (pre-emption): the writer's spawned manager
    ignores it, so the checkpoint written for that signal still collects its results (before: the manager died of
    it and the save failed with BrokenPipeError, seen in the Slurm job once checkpoints ran by the clock)."""
    driver = _python(PREEMPTED, stdin=subprocess.PIPE)
    manager = int(driver.stdout.readline())
    os.kill(manager, signal.SIGUSR1)
    time.sleep(0.5)
    assert psutil.pid_exists(manager) and psutil.Process(manager).status() != psutil.STATUS_ZOMBIE
    driver.stdin.write("go\n")
    driver.stdin.flush()
    assert driver.stdout.readline().strip() == "2"
    driver.wait(30)


def test_a_stopped_trainer_rank_is_named_and_ends_the_wait():
    """A rank stopped by SIGSTOP holds its peers in a collective for torch's 30-minute timeout, silently: the
    launcher's wait finds it (state T, RANK in its environment), continues it and raises naming it."""
    import signal as _signal
    import subprocess as _sp
    import sys as _sys

    from mega_async.launch.local import RankStopped, _wait_watching
    from mega_async.utils.lifeline import stopped_ranks

    code = ("import os, subprocess, sys, time\n"
            "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], env={**os.environ, "
            "'RANK': str(r)}) for r in (0, 1)]\n"
            "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
            "time.sleep(60)\n")
    parent = _sp.Popen([_sys.executable, "-c", code], stdout=_sp.PIPE, text=True)
    try:
        kids = [int(x) for x in parent.stdout.readline().split()]
        os.kill(kids[1], _signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while stopped_ranks(parent.pid) != [(1, kids[1])] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stopped_ranks(parent.pid) == [(1, kids[1])]
        t0 = time.monotonic()
        with pytest.raises(RankStopped, match=rf"trainer rank 1 \(pid {kids[1]}\) has been stopped"):
            _wait_watching(parent, stopped_for=1.0)
        assert time.monotonic() - t0 < 10
        assert stopped_ranks(parent.pid) == []  # continued, so the stop that follows can end it
    finally:
        for pid in [parent.pid, *kids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, _signal.SIGKILL)
        parent.wait()
