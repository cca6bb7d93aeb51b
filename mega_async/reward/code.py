"""Code reward: the completion's last fenced code block runs against the item's reference tests in a sandbox.

sandbox = a fresh scratch directory (removed afterwards) + `python -I` + resource limits set before the
solution runs (address space, CPU seconds, file size, open files) + no network and its own PID namespace
(`unshare -n -p --kill-child`, when the kernel lets us; otherwise a warning says the sandbox has network) +
a wall-clock timeout that kills the process group (and the namespace) + stdout read in bounded chunks.
Reward = fraction of tests passed (1.0 = all).
A sandbox that times out, dies on a signal (e.g. the memory limit) or prints more than `max_output_bytes`
raises `CodeRewardError`, so the RewardRunner rejects the sample; the rollout loop never waits on it
(everything is asyncio). Not a defence against code that deliberately inspects the harness.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from functools import lru_cache
from typing import Any, Optional, Sequence

logger = logging.getLogger("mega_async.reward.code")

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

# The harness: limits first, then the solution and each test in one namespace; the result line carries a
# nonce read from stdin, so a solution that prints or exits early cannot fake a pass.
_HARNESS = r'''
import json, os, resource, sys
def _limit(name, value):
    try:
        resource.setrlimit(getattr(resource, name), (value, value))
    except (ValueError, OSError, AttributeError):
        pass
def _main(_w=os.write):
    cfg = json.loads(sys.stdin.readline())
    nonce = cfg["nonce"]
    _limit("RLIMIT_AS", cfg["memory_bytes"])
    _limit("RLIMIT_CPU", cfg["cpu_seconds"])
    _limit("RLIMIT_FSIZE", cfg["file_bytes"])
    _limit("RLIMIT_NOFILE", 64)
    _limit("RLIMIT_CORE", 0)
    with open("solution.py") as f:
        src = f.read()
    with open("tests.json") as f:
        tests = json.load(f)
    ns = {"__name__": "__main__"}
    passed = 0
    try:
        exec(compile(src, "solution.py", "exec"), ns)
        ok = True
    except BaseException:
        ok = False
    if ok:
        for i, t in enumerate(tests):
            try:
                exec(compile(t, f"test_{i}", "exec"), ns)
                passed += 1
            except BaseException:
                pass
    _w(1, f"\n{nonce} {passed} {len(tests)}\n".encode())
_main()
'''


class CodeRewardError(RuntimeError):
    """The sandbox timed out, was killed, or flooded its output: the sample is rejected."""


def extract_code(completion: str, languages: Sequence[str] = ("python", "py", "python3", "")) -> Optional[str]:
    """The last fenced code block in a language of `languages` ("" = an unlabelled fence), or None."""
    blocks = [body for lang, body in _FENCE.findall(completion) if lang.lower() in languages]
    return blocks[-1] if blocks else None


@lru_cache(maxsize=1)
def network_isolation() -> tuple[str, ...]:
    """The command prefix that runs the sandbox without network and, where the kernel allows, in its own PID
    namespace that dies with it (`--kill-child`: children that escaped the process group go too). Tried as
    root (`unshare -n`) and with user namespaces (`-rn`); () with a warning when nothing works here."""
    exe = shutil.which("unshare")
    pid_ns = ("-p", "-f", "--kill-child")
    for prefix in (("-n", *pid_ns), ("-rn", *pid_ns), ("-n",), ("-rn",)):
        if exe is None:
            break
        try:
            if subprocess.run([exe, *prefix, "true"], capture_output=True, timeout=10, check=False).returncode == 0:
                return (exe, *prefix)
        except (OSError, subprocess.TimeoutExpired):
            pass
    logger.warning("unshare -n is not available here: the code sandbox runs WITH network access")
    return ()


class CodeReward:
    """`await CodeReward()(prompt, completion, tests=[...])` -> fraction of tests passed, see the module doc."""

    def __init__(self, timeout: float = 5.0, memory_mb: int = 512, cpu_seconds: int = 5,
                 max_output_bytes: int = 1 << 16, max_concurrent: Optional[int] = None, isolate_network: bool = True):
        self.timeout, self.memory_mb, self.cpu_seconds = timeout, memory_mb, cpu_seconds
        self.max_output_bytes = max_output_bytes
        self.max_concurrent = max_concurrent or max(1, os.cpu_count() or 1)
        self.isolate_network = isolate_network
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
        tests = [tests] if isinstance(tests, str) else list(tests)
        code = extract_code(completion)
        if code is None:
            return 0.0  # no code block: a wrong answer, not a broken reward
        async with self._sem():
            passed, total = await self.run(code, tests)
        return passed / max(total, 1)

    async def run(self, code: str, tests: list[str]) -> tuple[int, int]:
        """Run `code` then each test in a sandbox; returns (passed, total)."""
        scratch = tempfile.mkdtemp(prefix="mega_async_code_")
        proc = None
        try:
            with open(os.path.join(scratch, "solution.py"), "w") as f:
                f.write(code)
            with open(os.path.join(scratch, "tests.json"), "w") as f:
                json.dump(tests, f)
            prefix = network_isolation() if self.isolate_network else ()
            if "--kill-child" in prefix:  # a shell is the namespace's PID 1, so the solution gets normal signals
                prefix = (*prefix, "/bin/sh", "-c", '"$0" "$@"; exit $?')
            proc = await asyncio.create_subprocess_exec(
                *prefix, sys.executable, "-I", "-c", _HARNESS, cwd=scratch, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": scratch, "PYTHONHASHSEED": "0"})
            nonce = secrets.token_hex(16)
            cfg = {"nonce": nonce, "memory_bytes": self.memory_mb << 20, "cpu_seconds": self.cpu_seconds,
                   "file_bytes": 16 << 20}
            proc.stdin.write((json.dumps(cfg) + "\n").encode())  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
            try:
                out = await asyncio.wait_for(self._read(proc), self.timeout)
                rc = await asyncio.wait_for(proc.wait(), self.timeout)
            except asyncio.TimeoutError:
                raise CodeRewardError(f"code sandbox timed out after {self.timeout:.1f}s") from None
            return self._verdict(out, rc, nonce, len(tests))
        finally:
            if proc is not None and proc.returncode is None:
                _kill(proc.pid)
                try:
                    await asyncio.wait_for(proc.wait(), 5.0)
                except (asyncio.TimeoutError, ProcessLookupError):
                    logger.warning("code sandbox pid %d did not exit after SIGKILL", proc.pid)
            shutil.rmtree(scratch, ignore_errors=True)

    async def _read(self, proc: asyncio.subprocess.Process) -> bytes:
        buf = bytearray()
        while True:
            chunk = await proc.stdout.read(1 << 14)  # type: ignore[union-attr]
            if not chunk:
                return bytes(buf)
            buf += chunk
            if len(buf) > self.max_output_bytes:
                raise CodeRewardError(f"code sandbox printed more than {self.max_output_bytes} bytes")

    @staticmethod
    def _verdict(out: bytes, rc: int, nonce: str, total: int) -> tuple[int, int]:
        for line in reversed(out.decode(errors="replace").splitlines()):
            parts = line.split()
            if len(parts) == 3 and parts[0] == nonce:
                return int(parts[1]), int(parts[2])
        if rc < 0 or rc > 128:  # killed (> 128: the status a shell reports for a killed child)
            sig = -rc if rc < 0 else rc - 128
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            raise CodeRewardError(f"code sandbox killed by {name} (memory or CPU limit?)")
        if rc == 0:  # the solution ended the process (os._exit) before the harness reported: no test passed
            return 0, total
        raise CodeRewardError(f"code sandbox exited with status {rc} without a result: {out[-200:]!r}")


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the whole session: the solution's children too
    except (ProcessLookupError, PermissionError):
        pass


code_reward = CodeReward()
