"""Limits on a code solution as a whole (every process it forks counts), for the sandbox launcher (sandbox.py loads
this file by path; standard library only).

Where this machine lets us make one, a cgroup per sandbox (v2, else v1), `mega-async-sandbox-<launcher pid>-<hex>`:
  S             memory.max = the job's memory limit (no swap), pids.max, cpu.max = one CPU: the whole sandbox
  S/supervisor  the namespace's PID 1 and the judge
  S/solution    the worker and all it forks, memory.max = the limit less SUPERVISOR_RESERVE; one OOM kill there
                ends the whole solution (memory.oom.group, and PID 1 kills what is left), so its tests fail
v2: S goes under the nearest cgroup (ours or an ancestor) that has memory and pids in its subtree_control; v1: under
our own cgroup of each of the memory, pids and cpu hierarchies. Elsewhere neither the worker nor the judge (it runs
the dataset's tests, untrusted too) may fork or start a thread (RLIMIT_NPROC 1), so each one's address-space limit
(RLIMIT_AS) bounds all it can take. The resource limits of every process
(address space, CPU seconds, file size, open files) apply in both cases.
"""
import os
import secrets
import signal
import time

PREFIX = "mega-async-sandbox-"
SUPERVISOR_RESERVE = 64 << 20  # bytes of the limit kept for PID 1 and the judge (two Python processes)
PIDS = 64  # processes and threads of the whole sandbox
CPU_PERIOD_US = 100_000
ROOT = "/proc/self"  # where mountinfo and cgroup are read (tests point it elsewhere)


class NoCgroup(Exception):
    """No writable cgroup with the memory and pids controllers here; the message says why."""


def _unescape(s: str) -> str:
    for k, v in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        s = s.replace(k, v)
    return s


def cgroup_mounts(root: str = ROOT) -> list:
    """(fstype, root of the mount, mount point, super options) of each cgroup mount."""
    out = []
    with open(f"{root}/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) > 4 and rest and rest[0] in ("cgroup", "cgroup2"):
                out.append((rest[0], _unescape(fields[3]), _unescape(fields[4]), rest[2] if len(rest) > 2 else ""))
    return out


def own_cgroups(root: str = ROOT) -> dict:
    """{controller: path} of this process from /proc/self/cgroup; "" is the v2 hierarchy."""
    out = {}
    with open(f"{root}/cgroup") as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) == 3:
                for c in parts[1].split(",") if parts[1] else [""]:
                    out[c] = parts[2]
    return out


def _directory(mount_root: str, point: str, path: str):
    """The directory of cgroup `path` under a mount of `mount_root` at `point`, or None where it is not visible."""
    if mount_root != "/":
        if path != mount_root and not path.startswith(mount_root.rstrip("/") + "/"):
            return None
        path = path[len(mount_root):]
    return point.rstrip("/") + ("/" + path.strip("/") if path.strip("/") else "")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _pread(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 1 << 16).decode()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: str, tries: int = 1) -> bool:
    """rmdir a cgroup and its children (empty ones only: the kernel refuses a populated cgroup)."""
    for _ in range(tries):
        try:
            for name in os.listdir(path):
                if os.path.isdir(os.path.join(path, name)):
                    _remove(os.path.join(path, name))
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.02)
    return False


def _sweep(parent: str) -> None:
    """Remove what a killed launcher left under `parent` (its pid no longer lives)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        pid = name[len(PREFIX):].split("-")[0] if name.startswith(PREFIX) else ""
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            _remove(os.path.join(parent, name))


class Plan:
    """One sandbox's limits: made on the host side before the namespaces, entered by PID 1 (`enter`, by the
    launcher) and the worker (`join_worker`, in its preexec_fn), watched by PID 1 (`watch`), removed at the end."""

    def __init__(self, memory_bytes: int):
        self.memory_bytes = memory_bytes
        self.solution_bytes = max(memory_bytes - SUPERVISOR_RESERVE, memory_bytes // 2)
        self.mode, self.describe = "rlimit", ""
        self.made: list = []  # (descriptor of the parent, name) of each directory made, parents first
        self.pid1: list = []  # cgroup.procs files PID 1 joins
        # worker join, OOM counter, solution's procs, cgroup.kill, peak usage: all opened before the new root (PID 1's
        # pivot_root moves the launcher's root too: afterwards only descriptors reach the cgroup files)
        self._fds: dict = {}

    # --- the host side ---------------------------------------------------------------------------------------
    def _mkdir(self, path: str) -> str:
        parent = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.mkdir(os.path.basename(path), 0o755, dir_fd=parent)
        except OSError:
            os.close(parent)
            raise
        self.made.append((parent, os.path.basename(path)))
        return path

    def _open(self, key: str, path: str, flags: int) -> None:
        if os.path.exists(path):
            self._fds[key] = os.open(path, flags | os.O_CLOEXEC)

    def make_v2(self, root: str = ROOT) -> None:
        mounts = [m for m in cgroup_mounts(root) if m[0] == "cgroup2"]
        path = own_cgroups(root).get("")
        if not mounts or path is None:
            raise NoCgroup("no cgroup v2 hierarchy")
        found = next(((d, m[2]) for m in mounts if (d := _directory(m[1], m[2], path)) is not None), None)
        if found is None:
            raise NoCgroup(f"our cgroup {path} is not under a cgroup v2 mount")
        base, top = found[0], found[1].rstrip("/") or "/"
        parent, why = base, f"no cgroup from {base} up to {top} delegates memory and pids"
        while True:
            enabled = set(_read(f"{parent}/cgroup.subtree_control").split())
            if parent == top and not {"memory", "pids"} <= enabled:  # the root may enable them (no process rule)
                wanted = {"memory", "pids", "cpu"} & set(_read(f"{parent}/cgroup.controllers").split())
                try:
                    _write(f"{parent}/cgroup.subtree_control", " ".join("+" + c for c in sorted(wanted)))
                    enabled = set(_read(f"{parent}/cgroup.subtree_control").split())
                except OSError as e:
                    why = f"cannot enable memory and pids in {parent}: {e.strerror}"
            if {"memory", "pids"} <= enabled:
                break
            if parent == top or "/" not in parent.rstrip("/"):
                raise NoCgroup(why)
            parent = os.path.dirname(parent)
        _sweep(parent)
        try:
            s = self._mkdir(f"{parent}/{PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        except OSError as e:
            raise NoCgroup(f"cannot create a cgroup in {parent}: {e.strerror}") from None
        _write(f"{s}/cgroup.subtree_control", "+memory")
        _write(f"{s}/memory.max", str(self.memory_bytes))
        _write(f"{s}/pids.max", str(PIDS))
        cpu = "cpu" in enabled
        if cpu:
            _write(f"{s}/cpu.max", f"{CPU_PERIOD_US} {CPU_PERIOD_US}")
        sup, sol = self._mkdir(f"{s}/supervisor"), self._mkdir(f"{s}/solution")
        _write(f"{sol}/memory.max", str(self.solution_bytes))
        swap = os.path.exists(f"{s}/memory.swap.max")
        for d in (s, sol) if swap else ():
            _write(f"{d}/memory.swap.max", "0")
        if os.path.exists(f"{sol}/memory.oom.group"):
            _write(f"{sol}/memory.oom.group", "1")
        self.pid1 = [f"{sup}/cgroup.procs"]
        self._open("peak", f"{s}/memory.peak", os.O_RDONLY)
        self._open("join", f"{sol}/cgroup.procs", os.O_WRONLY)
        self._open("events", f"{sol}/memory.events", os.O_RDONLY)
        self._open("procs", f"{sol}/cgroup.procs", os.O_RDONLY)
        self._open("kill", f"{sol}/cgroup.kill", os.O_WRONLY)
        self.mode = "cgroup2"
        self.describe = self._line(2, parent, swap, cpu)

    def make_v1(self, root: str = ROOT) -> None:
        own, dirs = own_cgroups(root), {}
        for fstype, mroot, point, opts in cgroup_mounts(root):
            for c in ("memory", "pids", "cpu"):
                if fstype == "cgroup" and c in opts.split(",") and c not in dirs and c in own:
                    d = _directory(mroot, point, own[c])
                    if d is not None:
                        dirs[c] = d
        if not {"memory", "pids"} <= set(dirs):
            raise NoCgroup("no cgroup v1 memory and pids hierarchies")
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        tops = {}
        for c, d in dirs.items():
            _sweep(d)
            try:
                tops[c] = self._mkdir(f"{d}/{name}")
            except OSError as e:
                if c == "cpu":
                    continue  # CPU then bounded by the timeout alone
                raise NoCgroup(f"cannot create a cgroup in {d}: {e.strerror}") from None
        s = tops["memory"]
        sup, sol = self._mkdir(f"{s}/supervisor"), self._mkdir(f"{s}/solution")
        swap = os.path.exists(f"{s}/memory.memsw.limit_in_bytes")
        for d, limit in ((s, self.memory_bytes), (sol, self.solution_bytes)):
            _write(f"{d}/memory.limit_in_bytes", str(limit))
            if swap:
                _write(f"{d}/memory.memsw.limit_in_bytes", str(limit))
        _write(f"{tops['pids']}/pids.max", str(PIDS))
        if "cpu" in tops:
            _write(f"{tops['cpu']}/cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(f"{tops['cpu']}/cpu.cfs_quota_us", str(CPU_PERIOD_US))
        self.pid1 = [f"{sup}/cgroup.procs", f"{tops['pids']}/cgroup.procs"]
        self.pid1 += [f"{tops['cpu']}/cgroup.procs"] if "cpu" in tops else []
        self._open("peak", f"{s}/memory.max_usage_in_bytes", os.O_RDONLY)
        self._open("join", f"{sol}/cgroup.procs", os.O_WRONLY)
        self._open("events", f"{sol}/memory.oom_control", os.O_RDONLY)
        self._open("procs", f"{sol}/cgroup.procs", os.O_RDONLY)
        self.mode = "cgroup1"
        self.describe = self._line(1, os.path.dirname(s), swap, "cpu" in tops)

    def _line(self, version: int, parent: str, swap: bool, cpu: bool) -> str:
        return (f"cgroup v{version} per solution (under {parent}): memory {self.memory_bytes >> 20} MiB in all, "
                f"{self.solution_bytes >> 20} MiB for the solution's processes{'' if swap else ' (swap not limited)'}"
                f", {PIDS} processes, " + ("one CPU" if cpu else "CPU bounded by the timeout (no cpu controller)"))

    def fall_back(self, why: str) -> None:
        """No cgroup after all (`why`): no fork in the sandbox (what was made is removed by `finish`)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.mode, self.pid1 = "rlimit", []
        self.describe = (f"no cgroup ({why}): the solution may not fork or start a thread (RLIMIT_NPROC 1), "
                         f"{self.memory_bytes >> 20} MiB of address space")

    def enter(self, pid: int) -> None:
        """Move the namespace's PID 1 (before it starts anything) into the supervisor's cgroups."""
        for procs in self.pid1:
            _write(procs, str(pid))

    def finish(self) -> dict:
        """The peak memory of the whole sandbox (bytes, where the kernel tells), then the cgroups removed."""
        out = {}
        if "peak" in self._fds:
            try:
                out["memory_peak"] = int(_pread(self._fds["peak"]))
            except (OSError, ValueError):
                pass
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for parent, name in reversed(self.made):  # children first; the last processes may take a moment to go
            for _ in range(50):
                try:
                    os.rmdir(name, dir_fd=parent)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
            os.close(parent)
        self.made = []
        return out

    # --- inside the sandbox ----------------------------------------------------------------------------------
    def join_worker(self) -> None:
        """preexec_fn of the worker, before it drops privileges: into the solution's cgroup."""
        if "join" in self._fds:
            os.write(self._fds["join"], b"0")

    def fork_limits(self) -> dict:
        """Resource limits the judge and the worker get on top of the common ones: without a cgroup, no fork and
        no thread (the count is per uid, at least one: the process itself)."""
        return {} if self.mode.startswith("cgroup") else {"RLIMIT_NPROC": 1}

    def watch(self) -> None:
        """Called by PID 1 while it waits: after an OOM kill in the solution's cgroup, the rest of it goes too."""
        fd = self._fds.get("events")
        if fd is None:
            return
        counts = dict(line.split() for line in _pread(fd).splitlines() if len(line.split()) == 2)
        if counts.get("oom_kill", "0") != "0":
            self.stop_solution()

    def stop_solution(self) -> None:
        if "kill" in self._fds:
            os.write(self._fds["kill"], b"1")
            return
        fd = self._fds.get("procs")
        for _ in range(100):  # what it forks meanwhile is in the same cgroup, and pids.max bounds it
            pids = [int(p) for p in _pread(fd).split() if int(p) > 1]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def make(memory_bytes: int, want: str = "auto") -> Plan:
    """The limits of one sandbox: a cgroup (v2, else v1) where one can be made here, else the no-fork worker.
    `want`: "auto" or "rlimit" (never a cgroup)."""
    if want == "rlimit":
        plan = Plan(memory_bytes)
        plan.fall_back("not asked for")
        return plan
    why = []
    for version in (2, 1):
        plan = Plan(memory_bytes)
        try:
            plan.make_v2() if version == 2 else plan.make_v1()
            return plan
        except (NoCgroup, OSError) as e:
            plan.finish()
            why.append(str(e) if isinstance(e, NoCgroup) else f"{e.filename}: {e.strerror}")
    plan.fall_back("; ".join(why))
    return plan
