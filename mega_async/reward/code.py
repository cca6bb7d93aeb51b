"""Code reward: the completion's last fenced code block runs against the item's reference tests in a sandbox.

The sandbox (sandbox.py) runs the solution in fresh mount, PID, network, IPC and UTS namespaces on a new
root that holds only read-only system and Python directories and private tmpfs /tmp and /dev/shm, with no
capabilities, `no_new_privs`, its own unprivileged uid (as root; otherwise a user namespace) and resource
limits (address space, CPU seconds, file size, open files, processes), and memory, processes and CPU bounded for
the solution as a whole (sandbox_limits.py: a cgroup per sandbox, or no fork at all; which one applies is logged
once at start-up by `check_sandbox`). The tests run in a second process,
the judge, against proxies of the solution's names: every value a test compares is a plain value decoded
in the judge (an object of the solution's cannot answer `==` there), and only the judge can write the
verdict, on a pipe the solution does not hold; the solution's output goes nowhere.
Reward = passed / total, in [0, 1]; a solution that crashes, exits, hangs or exceeds a limit fails the
tests it did not pass. `CodeRewardError` (the RewardRunner rejects the sample) only when the sandbox
itself fails; `SandboxUnavailable` with a one-line reason where this machine cannot build one (never an
unsandboxed run). Everything is asyncio: the rollout loop never waits on a sandbox.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
from functools import lru_cache
from typing import Any, Optional, Sequence

from mega_async.reward import RewardUnavailable

logger = logging.getLogger("mega_async.reward.code")

_LANG = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")
_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox.py")
_UNAVAILABLE = 3  # sandbox.UNAVAILABLE (sandbox.py runs as a script, so it is not imported here)
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}  # nothing of the trainer's environment
_GRACE = 3.0  # seconds past `timeout` before the host kills a sandbox that did not report (process start-up)
_KEEP = 1 << 16  # bytes kept of the launcher's stdout and stderr (the rest is read and dropped)


class CodeRewardError(RuntimeError):
    """The sandbox failed or timed out without a verdict: the sample is rejected."""


class SandboxUnavailable(CodeRewardError, RewardUnavailable):
    """This machine cannot build the sandbox (no namespaces); the message says why and what would fix it."""


def extract_code(completion: str, languages: Sequence[str] = ("python", "py", "python3", "")) -> Optional[str]:
    """The last fenced code block in a language of `languages` ("" = an unlabelled fence), or None: an opening
    ``` and its header line, the body up to the next ```. One pass of str.find, linear in the completion
    (the regex it replaces backtracked quadratically: 24 KB of backticks took 1.3 s, on the event loop)."""
    found, pos = None, 0
    while (start := completion.find("```", pos)) != -1:
        newline = completion.find("\n", start + 3)
        end = completion.find("```", newline + 1) if newline != -1 else -1
        if end == -1:
            break  # no later opening can close either
        lang = _LANG.match(completion, start + 3, newline).group(1)  # type: ignore[union-attr]
        if lang.lower() in languages:
            found = completion[newline + 1:end]
        pos = end + 3
    return found


def _tests(tests: Any) -> list[str]:
    tests = [tests] if isinstance(tests, str) else list(tests) if isinstance(tests, (list, tuple)) else None
    if not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError("code reward needs the item's `tests`: a non-empty list of Python test snippets (str)")
    return tests


class CodeReward:
    """`await CodeReward()(prompt, completion, tests=[...])` -> fraction of tests passed, see the module doc.

    `isolation`: "auto" (as root: namespaces and an unprivileged uid per process; otherwise a user
    namespace), "uid" or "userns" to insist on one."""

    def __init__(self, timeout: float = 5.0, memory_mb: int = 512, cpu_seconds: int = 5,
                 max_concurrent: Optional[int] = None, isolation: str = "auto"):
        if isolation not in ("auto", "uid", "userns"):
            raise ValueError(f"isolation={isolation!r}: use 'auto', 'uid' or 'userns'")
        self.timeout, self.memory_mb, self.cpu_seconds = timeout, memory_mb, cpu_seconds
        self.max_concurrent = max_concurrent or max(1, os.cpu_count() or 1)
        self.isolation = isolation
        self._sems: dict[int, asyncio.Semaphore] = {}
        self.__name__ = "code_reward"

    def _sem(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        sem = self._sems.get(id(loop))
        if sem is None:
            sem = self._sems[id(loop)] = asyncio.Semaphore(self.max_concurrent)
        return sem

    async def __call__(self, prompt: str, completion: str, tests: Any = None, **_: Any) -> float:
        if tests is None:
            raise ValueError("code reward needs the item's `tests` (a list of Python test snippets)")
        tests = _tests(tests)
        code = extract_code(completion)
        if code is None:
            return 0.0  # no code block: a wrong answer, not a broken reward
        async with self._sem():
            passed, total = await self.run(code, tests)
        return passed / total

    def job(self, code: str, tests: list[str]) -> bytes:
        """The launcher's stdin."""
        return json.dumps({"code": code, "tests": tests, "timeout": self.timeout, "isolation": self.isolation,
                           "memory_bytes": self.memory_mb << 20, "cpu_seconds": self.cpu_seconds,
                           "file_bytes": 16 << 20, "tmp_bytes": 64 << 20}).encode()

    async def run(self, code: str, tests: list[str]) -> tuple[int, int]:
        """Run `code` and then `tests` in a sandbox; returns (passed, total)."""
        tests = _tests(tests)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", _LAUNCHER, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, env=_ENV)
        task = asyncio.ensure_future(collect(proc, self.job(code, tests), _KEEP))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout + _GRACE)
            if not done:
                raise CodeRewardError(f"code sandbox gave no verdict within {self.timeout + _GRACE:.1f}s")
            out, err, rc = task.result()
        finally:
            if proc.returncode is None:
                _kill(proc.pid)
            if not task.done():
                await asyncio.wait({task}, timeout=5.0)  # collect reads to EOF, so this ends once it is dead
                if not task.done():
                    task.cancel()
                    logger.warning("code sandbox pid %d did not exit after SIGKILL", proc.pid)
        return verdict(out, err, rc, len(tests))


async def collect(proc: asyncio.subprocess.Process, stdin: bytes, keep: int) -> tuple[bytes, bytes, int]:
    """Feed `stdin`, read stdout and stderr to EOF (keeping the first `keep` bytes of each), then reap.
    Reading always continues to EOF: asyncio (3.11) reports a process's exit only once its pipes closed,
    and a stream nobody reads stops at 128 KiB, so a reader that gave up early made wait() hang."""
    async def drain(stream: asyncio.StreamReader) -> bytes:
        kept = bytearray()
        while chunk := await stream.read(1 << 16):
            kept += chunk[:max(0, keep - len(kept))]
        return bytes(kept)

    async def feed() -> None:
        try:
            proc.stdin.write(stdin)  # type: ignore[union-attr]
            await proc.stdin.drain()  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died before reading: its stderr says why

    out, err, _ = await asyncio.gather(drain(proc.stdout), drain(proc.stderr), feed())  # type: ignore[arg-type]
    return out, err, await proc.wait()


def verdict(out: bytes, err: bytes, rc: int, total: int) -> tuple[int, int]:
    """(passed, total) from the launcher's one stdout line; anything else is a failed sandbox."""
    why = err.decode(errors="replace").strip().splitlines()
    why = why[-1] if why else f"exit status {rc}"
    if rc == _UNAVAILABLE:
        raise SandboxUnavailable(why)
    try:
        v = json.loads(out)
        passed, count = v["passed"], v["total"]
        ok = rc == 0 and type(passed) is int and count == total and 0 <= passed <= total
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CodeRewardError(f"code sandbox gave no verdict ({why}; stdout {out[:200]!r})")
    if not v.get("complete", True):
        logger.debug("code sandbox: the tests stopped early (the solution died, hung or hit a limit)")
    return passed, total


@lru_cache(maxsize=1)
def check_sandbox() -> str:
    """Run a one-test job in the sandbox (synchronously, once per process); returns "ok" or raises
    SandboxUnavailable with the machine's reason, so a run that scores code refuses at start-up. Logs (one line)
    how a solution's memory, processes and CPU are bounded here: a cgroup, or no fork."""
    reward = CodeReward(timeout=20.0)
    job = {**json.loads(reward.job("x = 1", ["assert x == 1"])), "report_limits": True}
    proc = subprocess.run([sys.executable, "-I", "-S", _LAUNCHER], input=json.dumps(job).encode(),
                          capture_output=True, timeout=60, env=_ENV, check=False)
    if verdict(proc.stdout, proc.stderr, proc.returncode, 1) != (1, 1):
        raise SandboxUnavailable("code sandbox: a passing test did not pass in the sandbox")
    logger.info("code sandbox: %s", json.loads(proc.stdout).get("limits", "limits unknown"))
    return "ok"


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the launcher and the namespace's PID 1 (whose exit ends the rest)
    except (ProcessLookupError, PermissionError):
        pass


code_reward = CodeReward()
