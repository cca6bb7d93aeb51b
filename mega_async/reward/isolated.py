"""Killable worker processes for reward code that untrusted input can make run without end.

A reward thread cannot be stopped: math-verify's sympy, given a completion such as `9^9^9^9`, computes for
ever inside one C call that holds the GIL, so the whole trainer freezes and no asyncio timeout helps. A
`WorkerPool` runs such a function in separate processes instead: each call goes to an idle worker (one is
started when none is idle, up to `max_workers`), and a call that does not answer within `timeout` seconds
(or whose worker dies) gets its worker SIGKILLed and raises `WorkerTimeout`; the next call starts a fresh one.

Workers are started lazily, from one long-lived thread of this process, and die with it: PR_SET_PDEATHSIG
(SIGKILL) ties each to that thread, an atexit hook kills them all, and a worker whose stdin closes exits.
Each has its own session (a terminal's Ctrl-C goes to the trainer only) and an address-space limit. Arguments
and results cross a pipe as one JSON line each, so only plain values pass; what the function prints goes
nowhere (the protocol has its own descriptors).
"""
from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import json
import logging
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Optional

logger = logging.getLogger("mega_async.reward.isolated")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds mega_async/
_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from mega_async.reward.isolated import _serve; _serve()"
_LIVE: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()
_SPAWNER: Optional[concurrent.futures.ThreadPoolExecutor] = None
_SPAWNER_LOCK = threading.Lock()


class WorkerTimeout(RuntimeError):
    """The call did not answer in time, or its worker died; the worker was killed."""


class WorkerError(RuntimeError):
    """The function raised in the worker (the message is its exception's type and text), or no worker started."""


def _spawner() -> concurrent.futures.ThreadPoolExecutor:
    # PR_SET_PDEATHSIG fires when the *thread* that started the child ends: start every worker from this one
    # thread, which lives as long as the process, so a worker first needed by a short-lived thread survives it.
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-spawner")
        return _SPAWNER


class _Worker:
    def __init__(self, target: str, memory_bytes: int, start_timeout: float):
        cmd = [sys.executable, "-c", _BOOT, _ROOT, target, str(os.getpid()), str(memory_bytes)]
        self.proc = _spawner().submit(
            subprocess.Popen, cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True).result()
        self._buf = b""
        try:
            ready = self._read(time.monotonic() + start_timeout)
        except WorkerTimeout as e:
            self.kill()
            raise WorkerError(f"reward worker {target} did not start within {start_timeout:.0f}s ({e})") from None
        if "err" in ready:
            self.kill()
            raise WorkerError(f"reward worker {target} could not start: {ready['err']}")

    def call(self, args: list, timeout: float) -> Any:
        try:
            self.proc.stdin.write(json.dumps(args).encode() + b"\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except OSError:  # it died while idle
            raise WorkerTimeout(f"worker exited (rc {self.proc.poll()})") from None
        reply = self._read(time.monotonic() + timeout)
        if "err" in reply:
            raise WorkerError(reply["err"])
        return reply["ok"]

    def _read(self, deadline: float) -> dict:
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1e3):
                raise WorkerTimeout("no answer in time")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise WorkerTimeout(f"worker exited (rc {self.proc.poll()})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()  # type: ignore[union-attr]
            except OSError:
                pass
        self.proc.wait()


class WorkerPool:
    """`call(*args)` runs `target` ("package.module:function", plain JSON values in and out) in a worker
    process within `timeout` seconds, else kills that worker and raises `WorkerTimeout`."""

    def __init__(self, target: str, *, timeout: float, max_workers: int = 4, memory_bytes: int = 4 << 30,
                 start_timeout: float = 60.0):
        self.target, self.timeout, self.max_workers = target, timeout, max_workers
        self.memory_bytes, self.start_timeout = memory_bytes, start_timeout
        self._idle: list[_Worker] = []
        self._count = 0  # idle + busy + starting
        self._cv = threading.Condition()
        self.started = self.killed = 0
        _LIVE.add(self)

    def call(self, *args: Any) -> Any:
        worker = self._acquire()
        try:
            result = worker.call(list(args), self.timeout)
        except WorkerError:
            self._release(worker)  # the function raised; the worker is fine
            raise
        except BaseException:  # timeout, death, broken pipe, KeyboardInterrupt: the worker is not reusable
            worker.kill()
            self.killed += 1
            self._release(None)
            raise
        self._release(worker)
        return result

    def _acquire(self) -> _Worker:
        with self._cv:
            while True:
                while self._idle:
                    w = self._idle.pop()
                    if w.alive():
                        return w
                    w.kill()
                    self._count -= 1
                if self._count < self.max_workers:
                    self._count += 1
                    break
                self._cv.wait()
        try:
            w = _Worker(self.target, self.memory_bytes, self.start_timeout)
        except BaseException:
            self._release(None)
            raise
        self.started += 1
        return w

    def _release(self, worker: Optional[_Worker]) -> None:
        with self._cv:
            if worker is None:
                self._count -= 1
            else:
                self._idle.append(worker)
            self._cv.notify()

    def close(self) -> None:
        """Kill the idle workers (a busy one is killed by its caller's timeout; at exit, by PDEATHSIG)."""
        with self._cv:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for w in idle:
            w.kill()


@atexit.register
def _close_all() -> None:
    for pool in list(_LIVE):
        pool.close()


def _forget_in_child() -> None:  # a forked child must not use (or kill) its parent's workers or spawner thread
    global _SPAWNER, _SPAWNER_LOCK
    _SPAWNER, _SPAWNER_LOCK = None, threading.Lock()
    for pool in list(_LIVE):
        pool._idle, pool._count, pool._cv = [], 0, threading.Condition()


os.register_at_fork(after_in_child=_forget_in_child)


def _serve() -> None:
    """The worker: argv = root, target, parent pid, address-space limit (bytes)."""
    target, parent, memory = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)  # the parent died before the line above
    proto_in, proto_out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # the function's prints must not reach the protocol
    os.close(null)

    def send(obj: dict) -> None:
        proto_out.write(json.dumps(obj).encode() + b"\n")
        proto_out.flush()

    try:
        module, _, name = target.partition(":")
        fn = getattr(__import__(module, fromlist=[name]), name)
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        memory = memory if hard == resource.RLIM_INFINITY else min(memory, hard)
        resource.setrlimit(resource.RLIMIT_AS, (memory, hard))
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line
        send({"err": f"{type(e).__name__}: {e}"})
        return
    send({"ready": True})
    for line in proto_in:  # EOF (the parent closed or died): exit
        try:
            send({"ok": fn(*json.loads(line))})
        except MemoryError:
            send({"err": "MemoryError: over the worker's address-space limit"})
        except Exception as e:  # noqa: BLE001
            send({"err": f"{type(e).__name__}: {str(e)[:500]}"})
