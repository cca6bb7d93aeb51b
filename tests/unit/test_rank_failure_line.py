"""The one line `mega-async train` ends with when its ranks fail (mega_async/launch/local.py): the rank and the
signal that killed it, not torchrun's exit code; a stop by a signal in words, not `StoppedByLauncher: 143`."""
import json
import os
import signal
import threading
import time

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from mega_async.launch import local
from mega_async.launch.agent import FAILURES, failure_records


def _dir(tmp_path, failures=None, notes=()):
    """An error directory as the agent and the ranks leave it: failures.json and rank<R>.<ext> notes (in order)."""
    if failures is not None:
        (tmp_path / FAILURES).write_text(json.dumps(failures))
    t = time.time() - 100
    for i, (name, text) in enumerate(notes):
        (tmp_path / name).write_text(text + "\n")
        os.utime(tmp_path / name, (t + i, t + i))
    return str(tmp_path)


def _f(rank, code, t, pid=100):
    return {"rank": rank, "exitcode": code, "pid": pid + rank, "time": t,
            "signal": signal.Signals(-code).name if code < 0 else None}


def test_the_agent_records_each_failed_rank_in_the_order_torchrun_saw_them():
    failures = {1: ProcessFailure(local_rank=1, pid=71, exitcode=-9, error_file=""),
                0: ProcessFailure(local_rank=0, pid=70, exitcode=1, error_file="")}
    recs = failure_records(failures)
    assert [(r["rank"], r["exitcode"], r["signal"], r["pid"]) for r in recs] == [(1, -9, "SIGKILL", 71),
                                                                                 (0, 1, None, 70)]


def test_a_rank_killed_by_a_signal_is_named_not_its_peers_errors(tmp_path):
    now = int(time.time())
    # rank 1 SIGKILLed; rank 0 failed in the same instant on its vanished peer (seen first: lower local rank)
    d = _dir(tmp_path, [_f(0, 1, now), _f(1, -9, now)], [("rank0.txt", "rank 0: RuntimeError: Connection closed")])
    assert local.failure_line(d, 1) == "trainer rank 1 was killed by SIGKILL (pid 101)"


def test_the_first_rank_error_wins_over_a_later_kill(tmp_path):
    now = int(time.time())  # rank 0 raised; rank 1 did not stop within torchrun's 30 s and was SIGKILLed
    d = _dir(tmp_path, [_f(0, 1, now - 31), _f(1, -9, now)], [("rank0.txt", "rank 0: SyncError: bucket 3")])
    assert local.failure_line(d, 1) == "rank 0: SyncError: bucket 3"


def test_a_rank_stopped_by_sigterm_from_outside_is_named(tmp_path):
    now = int(time.time())
    stop = local.StoppedByLauncher(signal.SIGTERM)
    d = _dir(tmp_path, [_f(1, 1, now), _f(0, 1, now)],
             [("rank1.stopped", f"trainer rank 1 was {stop}"), ("rank0.stopped", f"trainer rank 0 was {stop}")])
    assert local.failure_line(d, 1) == ("trainer rank 1 was stopped by SIGTERM (sent by a scheduler, `kill` or "
                                        "the system)")


def test_without_any_note_the_exit_code_or_the_launchers_own_end(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    d = _dir(tmp_path / "a", [_f(1, 3, int(time.time()))])
    assert local.failure_line(d, 1) == ("trainer rank 1 exited with code 3 (pid 101) without an error message; see "
                                        "the log above")
    assert local.failure_line(str(tmp_path / "b"), -9) == "the rank launcher (torchrun) was killed by SIGKILL"


def test_a_stop_by_signal_reads_in_words():
    assert str(local.StoppedByLauncher(signal.SIGTERM)) == ("stopped by SIGTERM (sent by a scheduler, `kill` or the "
                                                            "system)")
    assert str(local.StoppedByLauncher(signal.SIGHUP)) == "stopped by SIGHUP (its terminal or ssh session closed)"
    assert local.StoppedByLauncher(signal.SIGTERM).code == 143


class _SlowFinalizer:
    def __init__(self, seen: list):
        self.seen = seen

    def __del__(self):
        t0 = time.monotonic()
        while not self.seen and time.monotonic() - t0 < 30:  # busy in the finalizer until the signal came
            pass


def test_a_stop_signal_that_lands_in_a_finalizer_is_not_lost(monkeypatch):
    """A SIGHUP that arrived while an asyncio transport's __del__ ran was raised there, printed as "Exception
    ignored" and lost: the run trained on. The handler now delivers it again once out of the finalizer. (The
    finalizer runs until the handler has seen the signal, however late a loaded machine delivers it.)"""
    from mega_async.launch import local

    seen: list = []
    first = local._redelivered_from_finalizer

    def spy(signum, frame):
        landed = first(signum, frame)
        seen.append(landed)
        return landed

    monkeypatch.setattr(local, "_redelivered_from_finalizer", spy)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a terminal leaves it (under nohup it is ignored: not stopped)
        local.stop_on_sigterm()
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGHUP)).start()
        with pytest.raises(local.StoppedByLauncher) as e:
            obj = _SlowFinalizer(seen)
            del obj  # the signal arrives inside __del__
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the redelivered signal raises here
                time.sleep(0.01)
        assert seen[0] is True  # it did land in the finalizer, and was sent again
        assert e.value.signum == signal.SIGHUP
    finally:
        for s, h in before.items():
            signal.signal(s, h)
