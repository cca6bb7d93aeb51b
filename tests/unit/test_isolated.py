"""WorkerPool: calls that hang inside one C call (holding the GIL) are killed; workers never outlive the trainer."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from mega_async.reward.isolated import WorkerError, WorkerPool, WorkerTimeout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaps (a container's PID 1 may not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_hung_call_is_killed_and_the_pool_recovers():
    pool = WorkerPool("math:factorial", timeout=1.0, max_workers=1)
    try:
        assert pool.call(5) == 120
        first = pool._idle[0].proc
        ticks, done = [], threading.Event()
        t = threading.Thread(target=lambda: (pytest.raises(WorkerTimeout, pool.call, 10 ** 9), done.set()))
        t.start()  # factorial(10**9) is one C call that never releases the GIL: only a kill ends it
        while not done.wait(0.01):
            ticks.append(1)
        t.join()
        assert len(ticks) >= 10  # this thread kept running meanwhile
        assert pool.killed == 1 and first.poll() is not None and _gone(first.pid)
        assert pool.call(6) == 720 and pool.started == 2
    finally:
        pool.close()


def test_function_errors_and_prints_keep_the_worker():
    pool = WorkerPool("builtins:print", timeout=5.0, max_workers=1)
    try:
        assert pool.call("this goes to the worker's stdout, not the protocol") is None
        assert pool.call("again") is None and pool.started == 1
    finally:
        pool.close()
    pool = WorkerPool("math:sqrt", timeout=5.0, max_workers=1)
    try:
        with pytest.raises(WorkerError, match="ValueError: math domain error"):
            pool.call(-1)
        assert pool.call(4) == 2.0 and pool.started == 1 and pool.killed == 0
    finally:
        pool.close()
    with pytest.raises(WorkerError, match="could not start: .*no_such_module"):
        WorkerPool("no_such_module:f", timeout=5.0).call()


def test_worker_started_by_a_short_lived_thread_survives_it():
    pool = WorkerPool("math:factorial", timeout=5.0, max_workers=1)
    try:
        t = threading.Thread(target=pool.call, args=(3,))
        t.start()
        t.join()  # PR_SET_PDEATHSIG follows the thread that started the child: workers start from one that stays
        time.sleep(0.2)
        assert pool.call(4) == 24 and pool.started == 1
    finally:
        pool.close()


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_workers_die_with_the_trainer(how):
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        sys.path.insert(0, {ROOT!r})
        from mega_async.reward.isolated import WorkerPool
        busy, idle = WorkerPool("math:factorial", timeout=600.0), WorkerPool("math:factorial", timeout=600.0)
        idle.call(3)
        threading.Thread(target=busy.call, args=(10 ** 9,), daemon=True).start()
        while not busy._count or busy.started < 1:
            time.sleep(0.01)
        time.sleep(0.3)
        print(idle._idle[0].proc.pid, flush=True)
        for p in os.listdir("/proc"):
            if p.isdigit() and p != str(os.getpid()):
                try:
                    if open(f"/proc/{{p}}/stat").read().split()[3] == str(os.getpid()):
                        print(p, flush=True)
                except OSError:
                    pass
        print("end", flush=True)
        os.kill(os.getpid(), signal.SIGKILL) if {how!r} == "sigkill" else sys.exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60).stdout
    pids = {int(p) for p in out.split("end")[0].split()}
    assert len(pids) == 2, out  # the busy and the idle worker
    deadline = time.monotonic() + 10
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(map(_gone, pids)), [p for p in pids if not _gone(p)]


def test_a_forked_child_starts_its_own_workers():
    pool = WorkerPool("math:factorial", timeout=5.0, max_workers=1)
    try:
        assert pool.call(3) == 6
        parent_worker = pool._idle[0].proc.pid
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the parent's spawner thread does not exist here
            ok = False
            try:
                ok = pool.call(4) == 24 and pool._idle[0].proc.pid != parent_worker
                pool.close()
            finally:
                os.write(w, b"1" if ok else b"0")
                os._exit(0)
        os.close(w)
        deadline = time.monotonic() + 30
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:  # before: its call waited for ever on a spawner thread it lacks
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child's call did not return")
            time.sleep(0.05)
        assert os.read(r, 1) == b"1"
        assert pool.call(5) == 120 and pool._idle[0].proc.pid == parent_worker  # the parent's is untouched
    finally:
        pool.close()
