"""The code reward's sandbox launcher: `python -I -S sandbox.py` reads a job (JSON) on stdin, runs the
solution and its tests inside fresh namespaces and writes one verdict line `{"passed", "total", "complete"}`
to stdout; standard library only (ctypes for the system calls Python lacks).

Layout: this process (host side) unshares mount, PID, network, IPC and UTS namespaces (as root; otherwise
inside a new user namespace) and forks the namespace's PID 1, which builds a new root on a tmpfs (read-only
binds of /usr, /etc, /bin, /lib* and the Python installation; a fresh, read-only /proc of the new PID
namespace; private tmpfs /tmp, /dev/shm and a minimal /dev), pivots into it and detaches the host's tree. It
then starts two processes with no capabilities, `no_new_privs`, resource limits and fresh unprivileged uids
(where the user namespace maps only one id: that one):
the judge, which alone holds the verdict pipe and runs the tests, and the worker, which runs the solution
(sandbox_harness.py). Nothing of the host's is reachable: no file to write, no process to see, no socket
(a new network namespace also isolates abstract unix sockets; filesystem sockets are not in the new root).
PID 1 exiting kills everything in the namespace. Exit status 3 with one line on stderr: no sandbox here.
Memory, processes and CPU are bounded for the solution as a whole (sandbox_limits.py: a cgroup per sandbox, or a
worker that cannot fork).
"""
import ctypes
import importlib.util
import json
import os
import resource
import secrets
import select
import signal
import subprocess
import sys
import time

UNAVAILABLE = 3  # exit status: this machine cannot build the sandbox (the line on stderr says why)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME, MNT_DETACH = 1 << 21, 1 << 24, 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom")
SCRATCH = "/tmp/scratch"
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SCRATCH, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
       "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

_spec = importlib.util.spec_from_file_location(
    "mega_async_sandbox_limits", os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_limits.py"))
limits_mod = importlib.util.module_from_spec(_spec)  # `python -I` puts no script directory on sys.path
_spec.loader.exec_module(limits_mod)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.syscall.restype = ctypes.c_long


class Refused(Exception):
    """The sandbox cannot be built here; the message names what failed and what would fix it."""


def _call(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _enc(s):
    return None if s is None else os.fsencode(s)


def mount(src, dst, fstype, flags: int, data=None) -> None:
    _call(_libc.mount(_enc(src), _enc(dst), _enc(fstype), flags, _enc(data)), f"mount {dst}")


def _prctl(option: int, arg: int) -> int:
    return _libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


# --- namespaces (host side) --------------------------------------------------------------------------------

class Ids:
    """Who the judge and the worker run as: `uids` (None: stay as this process is) and whether the
    user namespace lets them drop supplementary groups."""

    def __init__(self, mode: str, uids=(None, None), setgroups: bool = True):
        self.mode, (self.judge, self.worker), self.setgroups = mode, uids, setgroups


def _id_ranges() -> list[tuple[int, int]]:
    """(first, count) of the ids this user namespace maps, for both uids and gids (the host: [(0, 2**32-1)])."""
    out = []
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/self/{name}") as f:
            out.append([(int(a), int(n)) for a, _, n in (line.split() for line in f if line.strip())])
    return [(max(a, b), min(a + n, b + m) - max(a, b)) for a, n in out[0] for b, m in out[1]
            if min(a + n, b + m) > max(a, b)]


def _fresh_uid(ranges: list[tuple[int, int]]):
    """An id nothing here belongs to (on the host: 100000 + up to 2**30), mapped in this user namespace, not 0
    and not 65533/65534; None where this namespace maps no such id (a rootless container mapping only root)."""
    if ranges == [(0, 4294967295)]:
        return 100_000 + secrets.randbelow(1 << 30)
    spans = [(max(a, 1000), a + n) for a, n in ranges if a + n > max(a, 1000)]
    for _ in range(100):
        if not spans:
            return None
        lo, hi = spans[secrets.randbelow(len(spans))]
        uid = lo + secrets.randbelow(hi - lo)
        if uid not in (65533, 65534):
            return uid
    return None


def _unshare_mapped(flags: int, maps: dict) -> bool:
    """unshare(flags) with id maps of more than our own id: only a process outside the new user namespace
    (with CAP_SETUID there) may write those, so a forked helper writes them once we have unshared."""
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    parent = os.getpid()
    helper = os.fork()
    if helper == 0:
        ok = b"0"
        try:
            if os.read(go_r, 1) == b"1":
                for name, text in maps.items():
                    with open(f"/proc/{parent}/{name}", "w") as f:
                        f.write(text)
                ok = b"1"
        finally:
            os.write(done_w, ok)
            os._exit(0)
    unshared = _libc.unshare(flags) == 0
    err = ctypes.get_errno()
    os.write(go_w, b"1" if unshared else b"0")
    mapped = os.read(done_r, 1) == b"1"
    os.waitpid(helper, 0)
    for fd in (go_r, go_w, done_r, done_w):
        os.close(fd)
    if unshared and not mapped:
        raise Refused("a user namespace was created but its uid map could not be written")
    ctypes.set_errno(err)
    return unshared


def unshare(isolation: str) -> Ids:
    """Enter new namespaces: 'uid' (as root: the judge and the worker get fresh unprivileged uids) or 'userns'
    (a new user namespace: no capability outside it; as root it maps fresh uids for the two processes,
    never the host's uid 0, which owns files such as /proc/sys/kernel/core_pattern). Refused when neither
    works here."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    errors = []
    root, ranges = os.geteuid() == 0, _id_ranges()
    if isolation in ("auto", "uid"):
        uids = (_fresh_uid(ranges), _fresh_uid(ranges))
        if not root:
            errors.append("as root: not root")
        elif None in uids:
            errors.append("as root: this user namespace maps no unprivileged id to run as")
        elif _libc.unshare(flags) == 0:
            return Ids("uid", uids)
        else:
            errors.append("as root: " + os.strerror(ctypes.get_errno()))
    if isolation in ("auto", "userns"):
        uid, gid = os.geteuid(), os.getegid()
        if root and ranges == [(0, 4294967295)]:  # the host's root: the two processes get fresh ids
            judge, worker = _fresh_uid(ranges), _fresh_uid(ranges)
            table = f"0 0 1\n65533 {judge} 1\n65534 {worker} 1"
            if _unshare_mapped(flags | CLONE_NEWUSER, {"uid_map": table, "gid_map": table}):
                return Ids("userns", (65533, 65534))
        elif _libc.unshare(flags | CLONE_NEWUSER) == 0:  # one id can be mapped: ours, seen as 65534 inside
            for name, text in (("setgroups", "deny"), ("uid_map", f"65534 {uid} 1"), ("gid_map", f"65534 {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            return Ids("userns", setgroups=False)
        errors.append("in a user namespace: " + os.strerror(ctypes.get_errno()))
    raise Refused(f"cannot create namespaces ({'; '.join(errors)}): run as root or enable unprivileged user "
                  "namespaces (sysctl kernel.unprivileged_userns_clone=1 user.max_user_namespaces=10000)")


# --- the new root (PID 1 of the namespace) -----------------------------------------------------------------

def _readonly_flags(path: str) -> int:
    """Flags that remount `path` read-only while keeping what a user namespace may not change (atime, noexec)."""
    f = os.statvfs(path).f_flag
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    flags |= MS_NOEXEC if f & os.ST_NOEXEC else 0
    if f & os.ST_NOATIME:
        flags |= MS_NOATIME
    elif f & os.ST_RELATIME:
        flags |= MS_RELATIME
    else:
        flags |= MS_STRICTATIME
    return flags | (MS_NODIRATIME if f & os.ST_NODIRATIME else 0)


def _mountpoints(mountinfo: str) -> list[str]:
    # no codec or module may be imported here: between the two pivots the Python installation is not at its path
    escapes = {"\\040": " ", "\\011": "\t", "\\012": "\n", "\\134": "\\"}
    out = []
    with open(mountinfo) as f:
        for line in f:
            point = line.split()[4]
            for k, v in escapes.items():
                point = point.replace(k, v)
            out.append(point)
    return out


def _bind_paths(extra: list[str]) -> list[str]:
    """System directories plus the Python installation, each once (one under
    another is bound with it)."""
    paths: list[str] = []
    for p in (*SYSTEM_DIRS, *extra):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in paths):  # _make_path skips a missing one
            paths.append(p)
    return paths


PRIVATE = ("/tmp", "/dev", "/proc")  # the sandbox's own mounts: the host's never show through them


def check_python_dirs(dirs: list[str]) -> None:
    """Refuse a Python installation whose directory is the root or one of the sandbox's private mounts (or holds
    one): binding it would show the host's /tmp, /dev or everything. Under them (a venv in /tmp/x) is fine."""
    for d in dirs:
        if d == "/" or any(d == p or p.startswith(d.rstrip("/") + "/") for p in PRIVATE):
            raise Refused(f"the Python installation's directory {d} is the root or one of the sandbox's private "
                          f"mounts ({', '.join(PRIVATE)}): install Python (or the venv) in a directory of its own")


def _make_path(old: str, new: str, path: str) -> bool:
    """Lay `path` out under `new` as it is under `old`: real directories as directories and, at the first symlink
    on the way (/lib -> usr/lib, a symlinked venv), the same symlink (its target, resolved, is bound on its own).
    True when `path` itself was made, to be bound; False when a symlink stands for it."""
    parts = [p for p in path.split("/") if p]
    cur = ""
    for part in parts[:-1]:
        cur += "/" + part
        if not os.path.lexists(old + cur):  # checked a component at a time: an absolute link under `old` would
            return False                     # resolve against this root, not the host's
        if os.path.islink(old + cur):
            if not os.path.lexists(new + cur):
                os.symlink(os.readlink(old + cur), new + cur)
            return False
        os.makedirs(new + cur, exist_ok=True)
    cur += "/" + parts[-1]
    if not os.path.lexists(old + cur):
        return False
    if os.path.islink(old + cur):
        if not os.path.lexists(new + cur):
            os.symlink(os.readlink(old + cur), new + cur)
        return False
    if os.path.isdir(old + cur):
        os.makedirs(new + cur, exist_ok=True)
    else:
        open(new + cur, "w").close()
    return True


def build_root(job: dict, worker_uid) -> None:
    """Make this mount namespace's root a fresh tmpfs holding only what a solution needs; see the module doc.
    The private /tmp is mounted before the binds, so a Python installation under /tmp (a venv in /tmp/...) is
    bound inside it rather than colliding with it."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0700")
    os.makedirs("/tmp/oldroot")
    os.makedirs("/tmp/newroot")
    os.chdir("/tmp")
    _call(_libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b"oldroot"), "pivot_root")
    os.chdir("/")
    new, old = "/newroot", "/oldroot"
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    os.makedirs(new + "/tmp")
    mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={job['tmp_bytes']},nr_inodes=4096,mode=1777")
    os.makedirs(new + SCRATCH)
    if worker_uid is not None:
        os.chown(new + SCRATCH, worker_uid, worker_uid)
    readonly = []
    for path in _bind_paths(job["python_dirs"]):
        if _make_path(old, new, path):
            mount(old + path, new + path, None, MS_BIND | MS_REC)
            readonly.append(new + path)
    os.makedirs(new + "/proc")
    # read-only: no sysctl, sysrq-trigger or /proc/<pid>/... write even for an id that owns them on the host
    mount("proc", new + "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for point in _mountpoints(new + "/proc/self/mountinfo"):
        if any(point == r or point.startswith(r + "/") for r in readonly):
            mount(None, point, None, _readonly_flags(point))
    os.makedirs(new + "/dev")
    mount("tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for dev in DEVICES:
        open(f"{new}/dev/{dev}", "w").close()
        mount(f"{old}/dev/{dev}", f"{new}/dev/{dev}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new}/dev/{name}")
    os.makedirs(new + "/dev/shm")
    mount("tmpfs", new + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,nr_inodes=256,mode=1777")
    mount(None, new + "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    os.chdir(new)
    _call(_libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _call(_libc.umount2(b".", MNT_DETACH), "umount the host's root")  # nothing of the host's stays mounted
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


# --- the two processes -------------------------------------------------------------------------------------

def _confine(uid, setgroups: bool, limits: dict, join=None):
    """preexec_fn: `join` (into the solution's cgroup), no capabilities (bounding set emptied), the given uid,
    no_new_privs, resource limits."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())

    def pre() -> None:
        if join is not None:
            join()
        for cap in range(last_cap + 1):
            _prctl(PR_CAPBSET_DROP, cap)
        if setgroups:
            os.setgroups([])
        if uid is not None:
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        _call(_prctl(PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")
        for name, value in limits.items():
            resource.setrlimit(getattr(resource, name), (value, value))
    return pre


def _spawn(role: str, job: dict, ids: Ids, fds: list[int], stdin: int, limits: dict, join=None) -> subprocess.Popen:
    cmd = [sys.executable, "-I", "-c", job["harness"], role, *map(str, fds)]
    stderr = 2 if role == "judge" and job.get("debug") else subprocess.DEVNULL  # debug: failing tests' tracebacks
    return subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.DEVNULL, stderr=stderr,
                            pass_fds=fds, cwd=SCRATCH, env=ENV,
                            preexec_fn=_confine(getattr(ids, role), ids.setgroups, limits, join))


def _write_all(fd: int, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BrokenPipeError:
        pass  # the reader died; the verdict says what it managed
    finally:
        os.close(fd)


def judge_and_report(job: dict, ids: Ids, plan) -> dict:
    """Start the judge and the worker (in the solution's cgroup, or unable to fork: `plan`); the solution's code
    goes to the worker once the judge is undumpable. Returns the last progress line the judge wrote."""
    start = time.monotonic()
    build_root(job, ids.worker)
    limits = {"RLIMIT_AS": job["memory_bytes"], "RLIMIT_CPU": job["cpu_seconds"], "RLIMIT_FSIZE": job["file_bytes"],
              "RLIMIT_NOFILE": 64, "RLIMIT_CORE": 0, "RLIMIT_NPROC": 64}
    verdict_r, verdict_w = os.pipe()
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    tests_r, tests_w = os.pipe()
    code_r, code_w = os.pipe()
    limits.update(plan.fork_limits())
    _spawn("judge", job, ids, [verdict_w, req_w, rep_r], tests_r, limits)
    _spawn("worker", job, ids, [req_r, rep_w], code_r, limits, plan.join_worker)
    for fd in (verdict_w, req_w, rep_r, tests_r, req_r, rep_w, code_r):
        os.close(fd)
    _write_all(tests_w, json.dumps({k: job.get(k) for k in ("tests", "timeout", "debug")}).encode())
    lines = _Lines(verdict_r, start + job["timeout"] + 0.5, plan.watch)
    if lines.next() is None:
        return {"error": "the judge did not start"}
    # The judge is undumpable now (its first line says so): only then may the solution's code run.
    _write_all(code_w, job["code"].encode())
    last = {"passed": 0, "done": 0}
    while (line := lines.next()) is not None:
        last = line
    total = len(job["tests"])
    return {"passed": last["passed"], "total": total, "complete": last["done"] == total}


class _Lines:
    """Progress lines from the judge, read until EOF or `deadline`; reaps zombies and calls `watch` while it waits."""

    def __init__(self, fd: int, deadline: float, watch=None):
        self.fd, self.deadline, self.buf, self.watch = fd, deadline, b"", watch

    def next(self):
        while b"\n" not in self.buf:
            left = self.deadline - time.monotonic()
            if left <= 0 or len(self.buf) > 1 << 16:
                return None
            if select.select([self.fd], [], [], min(left, 0.05))[0]:
                chunk = os.read(self.fd, 1 << 16)
                if not chunk:
                    return None
                self.buf += chunk
            _reap()
            if self.watch is not None:
                self.watch()
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            out = json.loads(line)
            return {"passed": int(out["passed"]), "done": int(out["done"])}
        except (ValueError, KeyError, TypeError):
            return None


def _reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def executable_hops(path: str) -> list[str]:
    """The directory of every link on the way from `path` to the interpreter (a venv's bin/python may point at
    another venv's, which points at the installation's): the sandbox needs each one to start Python."""
    out, seen = [], set()
    while path not in seen and len(seen) < 40:
        seen.add(path)
        out.append(os.path.dirname(os.path.abspath(path)))
        if not os.path.islink(path):
            break
        path = os.path.join(os.path.dirname(path), os.readlink(path))
    out.append(os.path.dirname(os.path.realpath(path)))
    return out


def main() -> int:
    job = json.loads(sys.stdin.buffer.read())
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_harness.py")) as f:
        job["harness"] = f.read()
    dirs = (sys.prefix, sys.base_prefix, sys.exec_prefix, *executable_hops(sys.executable))
    job["python_dirs"] = sorted({f(p) for p in dirs for f in (os.path.abspath, os.path.realpath)})  # named, resolved
    check_python_dirs(job["python_dirs"])
    if os.uname().machine not in SYS_PIVOT_ROOT:
        raise Refused(f"no pivot_root system call number for {os.uname().machine} in mega_async/reward/sandbox.py")
    plan = limits_mod.make(job["memory_bytes"], job.get("solution_limits", "auto"))
    try:
        return _run(job, plan)
    finally:
        plan.finish()


def _run(job: dict, plan) -> int:
    """Namespaces, PID 1 (moved into the sandbox's cgroup before it starts anything) and the verdict line it
    gives, with the limits that applied and the peak memory where the job asks (`report_limits`)."""
    ids = unshare(job.get("isolation", "auto"))
    go_r, go_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # PID 1 of the new namespace: dies with this process, and everything inside dies with it
        code = 1
        try:
            os.close(go_w)
            os.close(out_r)
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            _prctl(PR_SET_DUMPABLE, 0)
            if os.read(go_r, 1) != b"1":
                plan.fall_back("the launcher could not move the sandbox into its cgroup")
            out = judge_and_report(job, ids, plan)
            os.write(out_w, (json.dumps(out) + "\n").encode())
            code = 0
        except OSError as e:
            sys.stderr.write(f"code sandbox: cannot build the sandbox here ({e}){_hint(ids.mode, e.errno)}\n")
            code = UNAVAILABLE
        except BaseException as e:  # noqa: BLE001 - one line to the host, never a traceback into its log
            sys.stderr.write(f"code sandbox: {type(e).__name__}: {e}\n")
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(go_r)
    os.close(out_w)
    try:
        plan.enter(pid)
        go = b"1"
    except OSError as e:
        plan.fall_back(f"cannot move the sandbox into its cgroup: {e.strerror}")
        go = b"0"
    os.write(go_w, go)
    os.close(go_w)
    out = b""
    while chunk := os.read(out_r, 1 << 16):
        out += chunk[:max(0, (1 << 16) - len(out))]
    os.close(out_r)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
    if code == 0 and out and job.get("report_limits"):
        out = (json.dumps({**json.loads(out), "limits": plan.describe, **plan.finish()}) + "\n").encode()
    os.write(1, out)
    return code


def _hint(mode: str, errno: int) -> str:
    """What would fix a failed mount: only a permission error in a user namespace has a known fix."""
    if mode != "userns" or errno not in (1, 13):  # EPERM, EACCES
        return ""
    if os.geteuid() == 0:
        return "; a user namespace may not mount here (a container?): try reward isolation 'uid'"
    return "; a user namespace may not mount here (a container?): run as root"


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Refused as e:
        sys.stderr.write(f"code sandbox: {e}\n")
        sys.exit(UNAVAILABLE)
