"""Attacks on the code reward (issue 18): a solution must reach nothing of the host's and must not be able to
forge its score; honest solutions still pass. Each attack runs for real in the sandbox (no mocks)."""
import asyncio
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mega_async
from mega_async.reward import code as code_mod
from mega_async.reward.code import CodeReward, CodeRewardError, SandboxUnavailable, check_sandbox, collect, verdict

# Where the launcher runs: as this process (root: 'uid' and a forced 'userns'), and inside a user namespace
# made like a rootless container's (root mapped, with or without a range of other ids; needs root here).
_NESTED = r"""
import os, sys
sys.path.insert(0, os.path.dirname(sys.argv[2]))
import sandbox
assert sandbox._unshare_mapped(sandbox.CLONE_NEWUSER, {"uid_map": sys.argv[1], "gid_map": sys.argv[1]})
os.execv(sys.executable, [sys.executable, "-I", "-S", sys.argv[2]])
"""
PLACES = {"uid": ([], "uid"), "userns": ([], "userns"),
          "rootless-with-ids": ([sys.executable, "-c", _NESTED, "0 0 1\n1 200000 65536"], "auto"),
          "rootless-root-only": ([sys.executable, "-c", _NESTED, "0 0 1"], "auto")}
if os.geteuid() != 0:
    PLACES = {"userns": PLACES["userns"]}


def score(code: str, tests: list[str], isolation: str = "auto", **kw) -> float:
    return asyncio.run(CodeReward(isolation=isolation, **kw)("", f"```python\n{code}\n```", tests=tests))


def launch(code: str, tests: list[str], isolation: str = "auto", prefix=(), debug: bool = False):
    """The launcher run directly (optionally under `prefix`): (verdict line, stderr)."""
    job = json.loads(CodeReward(isolation=isolation).job(code, tests))
    job["debug"] = debug
    p = subprocess.run([*prefix, *([] if prefix else [sys.executable, "-I", "-S"]), code_mod._LAUNCHER],
                       input=json.dumps(job).encode(), capture_output=True, timeout=60, check=False)
    return p.stdout.decode(), p.stderr.decode(errors="replace")


def explain(code: str, tests: list[str], isolation: str = "auto", prefix=()) -> str:
    """The verdict and the judge's tracebacks of the failing tests (for assertion messages)."""
    out, err = launch(code, tests, isolation, prefix, debug=True)
    return out + err[-6000:]


def assert_all_pass(code: str, tests: list[str], isolation: str = "auto") -> None:
    got = score(code, tests, isolation)
    assert got == 1.0, f"score {got}:\n{explain(code, tests, isolation)}"


PROBE = r'''
import ctypes, os, socket
def probe():
    out = {"written": [], "read": [], "connected": []}
    for path in TARGETS:
        try:
            with open(path, "a") as f:
                f.write("pwned")
            out["written"].append(path)
        except OSError:
            pass
    out["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    others = [p for p in out["pids"] if p != os.getpid()] + [HELPER]
    for pid in others:
        for name in ("environ", "mem", "fd/0", "fd/1", "fd/3", "cmdline"):
            try:
                with open(f"/proc/{pid}/{name}", "rb") as f:
                    data = f.read(4096)
                if name != "cmdline" or SECRET.encode() in data:
                    out["read"].append(f"{pid}/{name}")
            except OSError:
                pass
    for addr in SOCKETS:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(addr)
            out["connected"].append(addr)
        except OSError:
            pass
    try:
        socket.create_connection(("127.0.0.1", PORT), timeout=1)
        out["connected"].append(PORT)
    except OSError:
        pass
    status = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
    out["caps"] = {k: int(status[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
    out["no_new_privs"] = status["NoNewPrivs"].strip()
    out["uid"] = os.getuid()
    libc = ctypes.CDLL(None, use_errno=True)
    out["mount"] = [libc.mount(b"none", b"/", None, 32 | 4096, None),   # remount / read-write
                    libc.mount(b"tmpfs", b"/tmp/scratch", b"tmpfs", 0, None),
                    libc.unshare(0x00020000)]                          # a new mount namespace
    out["sysctl"] = []  # host-wide knobs (a piped core_pattern runs a program as root on the host)
    for knob in ("/proc/sys/kernel/core_pattern", "/proc/sysrq-trigger", "/proc/sys/vm/drop_caches",
                 "/proc/self/oom_score_adj"):
        try:
            open(knob, "w").close()
            out["sysctl"].append(knob)
        except OSError:
            pass
    return out
'''


@pytest.mark.parametrize("place", list(PLACES))
def test_a_solution_reaches_nothing_of_the_host(tmp_path, place):
    """Writes outside its scratch dir (a dir the test owns, the project's source, the venv, $HOME, the host's
    /tmp), reads another process's environ/mem/fds, lists host pids, connects to a unix socket (path and
    abstract) and to loopback TCP, keeps a capability or uid 0, mounts, unshares, writes a host-wide sysctl
    (core_pattern) or sysrq-trigger: every one fails, wherever the launcher runs."""
    secret = secrets.token_hex(8)
    owned = tmp_path / "owned"
    owned.mkdir(mode=0o777)
    owned.chmod(0o777)
    existing = owned / "existing.txt"
    existing.write_text("orig")
    existing.chmod(0o666)
    targets = [str(owned / "new.txt"), str(existing), str(Path(mega_async.__file__).parent / f"pwned_{secret}"),
               os.path.join(sys.prefix, f"pwned_{secret}"), os.path.expanduser(f"~/pwned_{secret}"),
               f"/tmp/pwned_{secret}", f"/pwned_{secret}", f"/etc/pwned_{secret}"]
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", secret],
                              env={"H18_SECRET": secret})
    path_sock, abstract, tcp = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX), socket.socket()
    try:
        path_sock.bind(str(owned / "s.sock"))
        os.chmod(owned / "s.sock", 0o777)
        abstract.bind(f"\0mega_async_test_{secret}")
        tcp.bind(("127.0.0.1", 0))
        for s in (path_sock, abstract, tcp):
            s.listen(1)
            s.setblocking(False)
        code = (f"TARGETS = {targets!r}\nHELPER = {helper.pid}\nSECRET = {secret!r}\n"
                f"SOCKETS = [{str(owned / 's.sock')!r}, '\\0mega_async_test_{secret}']\n"
                f"PORT = {tcp.getsockname()[1]}\n" + PROBE)
        # its own private /tmp only (where the interpreter lives under /tmp, its bind sits inside that tmpfs;
        # the host-side check at the end shows nothing reached the host's files)
        tests = ["r = probe()", f"assert '/tmp/pwned_{secret}' in r['written'], r",
                 "assert all(p.startswith('/tmp/') for p in r['written']), r",
                 "assert r['read'] == [], r", "assert r['connected'] == [], r",
                 "assert len(r['pids']) <= 3 and max(r['pids']) <= 10",  # the namespace's PID 1, the judge, itself
                 "assert set(r['caps'].values()) == {0} and r['no_new_privs'] == '1', r",
                 "assert r['uid'] != 0, r",
                 "assert r['mount'] == [-1, -1, -1] and r['sysctl'] == [], r"]
        prefix, isolation = PLACES[place]
        if prefix:
            out, _ = launch(code, tests, isolation, prefix)
            assert json.loads(out) == {"passed": len(tests), "total": len(tests), "complete": True}, \
                explain(code, tests, isolation, prefix)
        else:
            assert_all_pass(code, tests, isolation)
        for s in (path_sock, abstract, tcp):
            with pytest.raises(BlockingIOError):
                s.accept()  # nobody connected
    finally:
        helper.kill()
        helper.wait()
        for s in (path_sock, abstract, tcp):
            s.close()
    assert existing.read_text() == "orig" and sorted(p.name for p in owned.iterdir()) == ["existing.txt", "s.sock"]
    assert not any(os.path.exists(t) for t in targets[2:])


def test_a_printed_or_written_verdict_is_not_the_score():
    """The old harness trusted a result line on stdout (a forged one scored 1000.0): the solution writes
    forged lines of both formats to stdout, stderr and every descriptor it holds, then exits 0."""
    forge = r'''
import json, os, sys
lines = ["\n" + "a" * 32 + " 1000 1\n", json.dumps({"passed": 1000, "total": 1, "complete": True}) + "\n",
         json.dumps({"passed": 2, "done": 2}) + "\n"]
for line in lines:
    print(line * 3)
    sys.stderr.write(line)
    for fd in FDS:
        try:
            os.write(fd, line.encode())
        except OSError:
            pass
def add(a, b):
    return a + b
'''
    assert score("FDS = [0, 1, 2]" + forge, ["assert False", "assert add(1, 2) == 3"]) == 0.5
    # every descriptor: that includes its own reply pipe, so the judge hears garbage and counts no test
    forge = "FDS = range(1024)" + forge
    assert score(forge, ["assert False", "assert add(1, 2) == 3"]) == 0.0
    assert score(forge + "\nos._exit(0)", ["assert add(1, 2) == 3"]) == 0.0  # exited before answering
    assert score(forge + "\nsys.exit(0)", ["assert True"]) == 0.0  # the solution did not run to its end


def test_objects_that_claim_equality_fail_every_comparison():
    """`__eq__` always true, `__bool__` always true, int/str/list subclasses that lie, arithmetic that returns
    a lie: every value a test compares is decoded in the judge, so only the honest control passes."""
    liars = r'''
class Eq:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __bool__(self): return True
    def __hash__(self): return 0
    def __sub__(self, other): return Eq()
    def __rsub__(self, other): return Eq()
    def __abs__(self): return 0.0
    def __lt__(self, other): return True
    def __len__(self): return 2
    def __iter__(self): return iter([1, 2])
class EqInt(int):
    def __eq__(self, other): return True
    __hash__ = int.__hash__
class EqStr(str):
    def __eq__(self, other): return True
    __hash__ = str.__hash__
class EqList(list):
    def __eq__(self, other): return True
import math
math.isclose = lambda *a, **k: True  # the worker's math, not the judge's
def abs(x): return 0.0  # shadows a builtin: the tests keep theirs
def add(a, b): return Eq()
def add_int(a, b): return EqInt(0)
def name(): return EqStr("wrong")
def items(): return EqList([0])
def is_even(n): return Eq()
def honest(a, b): return a + b
'''
    tests = ["assert add(1, 2) == 3", "assert 3 == add(1, 2)", "assert not (add(1, 2) != 3)",
             "assert add_int(1, 2) == 3", "assert name() == 'right'", "assert items() == [1, 2]",
             "assert is_even(3)", "assert abs(add(1, 1) - 3) < 1e-9", "assert add(1, 2) < 0",
             "assert [1, 2] == list(items())", "assert math.isclose(honest(1, 2), 4)",
             "assert abs(honest(1, 2) - 4) < 1e-9", "assert honest(1, 2) == 3"]
    got = score(liars, tests)
    assert got == pytest.approx(1 / len(tests)), explain(liars, tests, "auto")
    # the honest forms of the same answers pass: subclasses and numpy values count as their plain values
    honest = ("import collections\nclass I(int): pass\nP = collections.namedtuple('P', 'x y')\n"
              "def f(): return I(3)\ndef g(): return P(1, 2)\ndef h(): return collections.Counter('aab')\n"
              "def gen(n):\n    yield from range(n)\nclass Box:\n    def __init__(self, v): self.v = v\n"
              "    def get(self): return self.v\n    def __len__(self): return 4\n"
              "def boom(): raise ValueError('no')")
    assert_all_pass(honest, ["assert f() == 3 and type(f()) is int", "assert g() == (1, 2)",
                             "assert h() == {'a': 2, 'b': 1}", "assert list(gen(3)) == [0, 1, 2]",
                             "b = Box(7)\nassert b.get() == 7 and b.v == 7 and len(b) == 4",
                             "try:\n    boom()\nexcept ValueError as e:\n    assert str(e) == 'no'\n"
                             "else:\n    assert False",
                             "import math\nassert math.isclose(f() / 2, 1.5)"])


def test_a_solution_that_speaks_the_protocol_itself_only_gives_data():
    """The solution takes over the worker's pipes: it sends its own name table (a `__builtins__` whose `abs`
    is its function, `abs` itself, a module name) and answers every request with 0. Data cannot change how
    the judge compares: only the test whose answer really is 0 passes."""
    hijack = r'''
import json, os, struct, sys
requests, replies = int(sys.argv[-2]), int(sys.argv[-1])
def send(obj):
    data = json.dumps(obj).encode()
    os.write(replies, struct.pack(">I", len(data)) + data)
fn = {"r": 1, "n": "function"}
send({"names": {"__builtins__": {"d": [["abs", fn], ["len", fn], ["AssertionError", fn]]}, "abs": fn,
                "__name__": fn, "sub": fn, "zero": fn, "math": {"m": "math"}}})
while True:
    size = struct.unpack(">I", os.read(requests, 4))[0]
    os.read(requests, size)
    send({"v": 0})
'''
    tests = ["assert abs(sub(5, 3) - 3) < 1e-9", "assert len([1, 2]) == 0", "assert sub(5, 3) == 2",
             "assert math.isclose(sub(5, 3), 2)", "assert zero() == 0"]
    assert score(hijack, tests) == pytest.approx(1 / len(tests)), explain(hijack, tests)


def test_the_tests_stay_out_of_the_solutions_reach():
    """The solution never receives the tests: it searches every process's cmdline, environ, fds and memory
    maps it may open, and the files under / and /tmp, for a token only a test holds."""
    token = secrets.token_hex(12)
    search = r'''
import os
def found():
    hits = []
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        for name in ["cmdline", "environ"] + [f"fd/{n}" for n in range(16)]:
            try:
                with open(f"/proc/{pid}/{name}", "rb") as f:
                    if TOKEN in f.read(1 << 20):
                        hits.append(f"{pid}/{name}")
            except OSError:
                pass
    for top in ("/tmp", "/dev/shm"):
        for root, _, files in os.walk(top):
            for n in files:
                try:
                    if TOKEN in open(os.path.join(root, n), "rb").read():
                        hits.append(n)
                except OSError:
                    pass
    return hits
'''
    tests = [f"TOKEN = {token!r}\nassert found() == []"]
    # the solution knows the token's name but not its value: it searches for the bytes the test embeds
    code = f"TOKEN = bytes.fromhex({token.encode().hex()!r})\n" + search
    assert_all_pass(code, tests)


def test_a_fork_bomb_is_bounded():
    bomb = ("import os, time\nn = 0\nfor n in range(1000):\n    try:\n        if os.fork() == 0:\n"
            "            time.sleep(30)\n            os._exit(0)\n    except OSError:\n        break")
    assert_all_pass(bomb, ["assert n < 100"])  # RLIMIT_NPROC stopped it; the sandbox's exit reaps them all


def test_collect_reads_floods_to_the_end_while_the_loop_is_busy(caplog):
    """The old reader stopped at its byte limit and then waited for the process: asyncio (3.11) reports an
    exit only once the pipes closed, and a full, unread pipe never closes, so wait() hung and the log said
    `code sandbox pid ... did not exit after SIGKILL`. collect() reads everything and keeps a prefix."""
    flood = "import sys\nsys.stdout.buffer.write(b'y' * (4 << 20))\nsys.stderr.buffer.write(b'x' * (4 << 20))"

    async def main():
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", flood, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)

        async def hog():  # another coroutine holds the loop while the pipes fill (a loaded machine)
            await asyncio.sleep(0.05)
            time.sleep(0.5)

        (out, err, rc), _ = await asyncio.wait_for(asyncio.gather(collect(proc, b"", 1000), hog()), 30)
        return out, err, rc

    caplog.set_level(logging.WARNING)
    assert asyncio.run(main()) == (b"y" * 1000, b"x" * 1000, 0)
    assert "did not exit" not in caplog.text


def test_the_verdict_is_bounded_and_only_the_launchers():
    assert verdict(b'{"passed": 1, "total": 2, "complete": true}\n', b"", 0, 2) == (1, 2)
    for line in (b'{"passed": 1000, "total": 1}', b'{"passed": -1, "total": 1}', b'{"passed": 1, "total": 5}',
                 b'{"passed": true, "total": 1}', b"garbage", b""):
        with pytest.raises(CodeRewardError):
            verdict(line, b"", 0, 1)
    with pytest.raises(SandboxUnavailable, match="namespaces"):
        verdict(b"", b"code sandbox: cannot create namespaces (...)\n", 3, 1)


@pytest.mark.skipif(os.geteuid() != 0, reason="drops CAP_SYS_ADMIN from a root process")
def test_no_isolation_is_a_one_line_refusal_never_an_unsandboxed_run():
    """Without CAP_SYS_ADMIN, 'uid' isolation cannot unshare: the launcher refuses in one line (exit 3),
    and 'auto' falls back to a user namespace."""
    job = CodeReward(isolation="uid").job("x = 1", ["assert x == 1"])
    cmd = ["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin", sys.executable, "-I", "-S",
           code_mod._LAUNCHER]
    p = subprocess.run(cmd, input=job, capture_output=True, timeout=60, check=False)
    assert p.returncode == 3 and p.stdout == b"" and len(p.stderr.decode().strip().splitlines()) == 1, p.stderr
    with pytest.raises(SandboxUnavailable, match="cannot create namespaces.*run as root or enable unprivileged"):
        verdict(p.stdout, p.stderr, p.returncode, 1)
    auto = subprocess.run(cmd, input=CodeReward().job("x = 1", ["assert x == 1"]), capture_output=True, timeout=60,
                          check=False)
    assert json.loads(auto.stdout) == {"passed": 1, "total": 1, "complete": True}, auto.stderr
    assert check_sandbox() == "ok"


def _venv(where: Path) -> str:
    """A bare venv (no pip) at `where`; returns its python as named there."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--symlinks", str(where)], check=True,
                   capture_output=True, timeout=120)
    return str(where / "bin" / "python")


LAYOUTS = ["tmp", "opt", "symlinked-tmp"] if os.geteuid() == 0 else ["tmp", "symlinked-tmp"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_sandbox_starts_wherever_the_interpreter_lives(tmp_path, layout):
    """A venv under /tmp (the private /tmp used to collide with its bind: 'File exists' and a wrong hint), under
    /opt, and reached through a symlink: the launcher run by that interpreter scores an honest solution."""
    if layout == "opt":
        base = Path("/opt") / f"mega_async_test_{secrets.token_hex(4)}"
    else:
        base = tmp_path
    try:
        python = _venv(base / "venv")
        if layout == "symlinked-tmp":
            (tmp_path / "link").symlink_to(base / "venv")
            python = str(tmp_path / "link" / "bin" / "python")
        job = CodeReward(isolation="auto").job("def f(x):\n    return 2 * x", ["assert f(2) == 4", "assert f(0) == 0"])
        p = subprocess.run([python, "-I", "-S", code_mod._LAUNCHER], input=job, capture_output=True, timeout=60,
                           check=False)
        assert p.returncode == 0 and json.loads(p.stdout) == {"passed": 2, "total": 2, "complete": True}, p.stderr
    finally:
        if layout == "opt":
            import shutil
            shutil.rmtree(base, ignore_errors=True)


def test_an_interpreter_in_a_private_mount_or_the_root_is_refused_in_one_line():
    """A Python installation whose directory is /tmp, /dev or / itself cannot be bound without showing the
    host's: the launcher refuses in one line naming the directory and the fix, and never hangs."""
    from mega_async.reward import sandbox

    for bad in ("/", "/tmp", "/dev"):
        with pytest.raises(sandbox.Refused, match=f"directory {bad} is the root or one of the sandbox's private"):
            sandbox.check_python_dirs(["/usr", bad])
    sandbox.check_python_dirs(["/tmp/venv", "/tmp/venv/bin", "/opt/py", "/usr"])  # under them is fine


# --- issue 33: limits for the solution as a whole -----------------------------------------------------------------
FORK_AND_ALLOCATE = r'''
import os, time
def spawn():
    r, w = os.pipe()
    if os.fork() == 0:
        b = b"\x01" * (300 << 20)  # touched, not just reserved
        os.write(w, b"1")
        time.sleep(60)
        os._exit(0)
    os.close(w)
    return r
done = failed = 0
for _ in range(8):
    try:
        r = spawn()
    except OSError:
        failed += 1
        continue
    done += os.read(r, 1) == b"1"
'''


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))


@pytest.mark.parametrize("want", ["auto", "rlimit"])
def test_a_solution_that_forks_and_allocates_is_bounded_as_a_whole(want):
    """Issue 33: RLIMIT_AS was per process, so 8 forked children of 300 MB each (a 512 MB limit) took 2.4 GB of the
    host. With a cgroup the whole solution is stopped at the limit (the cgroup's peak stays under it) and its test
    fails; without one (or asked for none) the worker cannot fork at all. Either way a verdict, never a crash."""
    job = json.loads(CodeReward(memory_mb=512).job(FORK_AND_ALLOCATE, ["assert done == 8"]))
    job.update(report_limits=True, solution_limits=want)
    before = _mem_available()
    p = subprocess.run([sys.executable, "-I", "-S", code_mod._LAUNCHER], input=json.dumps(job).encode(),
                       capture_output=True, timeout=60, check=False)
    drop = (before - _mem_available()) >> 20
    v = json.loads(p.stdout)
    assert p.returncode == 0 and v["passed"] == 0 and v["total"] == 1, (p.stderr, v)
    assert "limits" in v, v
    if v["limits"].startswith("cgroup"):
        assert 0 < v["memory_peak"] <= 512 << 20, (v, f"host MemAvailable fell {drop} MiB")
    else:
        assert v["limits"].startswith("no cgroup") and "RLIMIT_NPROC 1" in v["limits"], v
        # it did run: every fork was refused, and a dataset's test (in the judge) cannot fork either
        job["tests"] = ["assert failed == 8 and done == 0",
                        "import os\ntry:\n    os.fork()\n    forked = True\nexcept OSError:\n    forked = False\n"
                        "assert not forked"]
        p = subprocess.run([sys.executable, "-I", "-S", code_mod._LAUNCHER], input=json.dumps(job).encode(),
                           capture_output=True, timeout=60, check=False)
        assert json.loads(p.stdout)["passed"] == 2, p.stdout
    assert score(FORK_AND_ALLOCATE, ["assert done == 8"], memory_mb=512) == 0.0  # through the reward: a score


def test_the_solutions_limits_are_logged_once_at_start_up(caplog):
    """Which bound applies here (a cgroup and its numbers, or no fork) is one log line when a run checks the
    sandbox at start-up."""
    caplog.set_level(logging.INFO, logger="mega_async.reward.code")
    assert check_sandbox.__wrapped__() == "ok"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("code sandbox: ")]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "per solution" in lines[0] or "RLIMIT_NPROC 1" in lines[0], lines


def test_cgroup_v2_limits_go_under_the_nearest_cgroup_that_delegates_memory_and_pids(tmp_path):
    """The v2 plan on a made-up hierarchy (this machine may have none): our cgroup /a/b has processes, so S goes
    under /a, whose subtree_control has memory and pids; S bounds the whole sandbox, S/solution the solution."""
    from mega_async.reward import sandbox

    lim = sandbox.limits_mod
    fs, proc = tmp_path / "cg", tmp_path / "proc"
    (fs / "a" / "b").mkdir(parents=True)
    proc.mkdir()
    (fs / "cgroup.subtree_control").write_text("")
    (fs / "cgroup.controllers").write_text("")
    (fs / "a" / "cgroup.subtree_control").write_text("cpu memory pids\n")
    (fs / "a" / "b" / "cgroup.subtree_control").write_text("\n")
    (proc / "mountinfo").write_text(f"41 31 0:38 / {fs} rw,relatime - cgroup2 cgroup2 rw\n")
    (proc / "cgroup").write_text("0::/a/b\n")
    plan = lim.Plan(512 << 20)
    plan.make_v2(str(proc))
    try:
        [s] = [d for d in (fs / "a").iterdir() if d.name.startswith(lim.PREFIX)]
        assert s.name.startswith(f"{lim.PREFIX}{os.getpid()}-")
        assert (s / "memory.max").read_text() == str(512 << 20) and (s / "pids.max").read_text() == "64"
        assert (s / "cpu.max").read_text() == "100000 100000"
        assert (s / "cgroup.subtree_control").read_text() == "+memory"
        assert (s / "solution" / "memory.max").read_text() == str(448 << 20)
        assert plan.pid1 == [f"{s}/supervisor/cgroup.procs"] and plan.mode == "cgroup2"
        assert plan.describe.startswith(f"cgroup v2 per solution (under {fs}/a): memory 512 MiB in all"), plan.describe
    finally:
        for d in (s / "solution", s / "supervisor", s):  # a real cgroupfs needs no file removed first
            for f in d.iterdir():
                if f.is_file():
                    f.unlink()
        plan.finish()
    assert not s.exists()
    (fs / "a" / "cgroup.subtree_control").write_text("pids\n")  # nothing delegates memory: no cgroup, a reason
    with pytest.raises(lim.NoCgroup, match="delegates memory and pids"):
        lim.Plan(512 << 20).make_v2(str(proc))
