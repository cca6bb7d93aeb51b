"""Several "hosts" on one machine for the multi-host tests: one Linux network namespace per node, each with
its own address on a bridge that lives in a namespace of its own, so nothing is added to the machine's
own network (no interface, address or route outside the namespaces made here; traffic goes only between
them). A command runs "on" a node through nsenter (its network) and unshare (its own host name, and
optionally its own /etc/hosts), as a process on another machine would: it sees only that node's address
and loopback.

Names start with `mamh-` and addresses are 10.213.0.<1 + i>/24; namespaces left by a killed run are found
by that prefix, their processes (`ip netns pids`) ended and the namespaces deleted before a new set is
made and after it. Needs root, iproute2 and util-linux (nsenter, unshare)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

PREFIX = "mamh-"
HUB = PREFIX + "hub"
SUBNET = "10.213.0"


def unavailable() -> Optional[str]:
    """Why network namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install iproute2 util-linux)"
    probe = PREFIX + "probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def _ours() -> list[str]:
    out = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in out if line.strip().startswith(PREFIX)]


def _pids(ns: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]


def remove_all(grace: float = 10.0) -> None:
    """End every process in a namespace of ours (SIGTERM, SIGKILL after `grace`) and delete the namespaces
    (their veths and the bridge go with them)."""
    spaces = _ours()
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for ns in spaces:
            for pid in _pids(ns):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_pids(ns) for ns in spaces):
            time.sleep(0.2)
    for ns in spaces:
        _ip("netns", "del", ns, check=False)


@dataclass(frozen=True)
class Node:
    index: int
    netns: str
    hostname: str
    address: str


class Hosts:
    """`n` nodes on one bridge; a context manager that removes stale namespaces first and its own after.

    hosts_files: each node gets its own /etc/hosts (e.g. Debian's `127.0.1.1 <hostname>`, the case where a
    host name resolves to loopback); without it the nodes' host names do not resolve at all."""

    def __init__(self, n: int, workdir: Path, hostname: str = "mh-n{i}", hosts_files: bool = False):
        self.workdir = Path(workdir)
        self.nodes = [Node(i, f"{PREFIX}n{i}", hostname.format(i=i), f"{SUBNET}.{i + 1}") for i in range(n)]
        self.hosts_files = hosts_files

    def __enter__(self) -> "Hosts":
        remove_all()
        try:
            self._make()
        except BaseException:
            remove_all()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        remove_all()

    def _make(self) -> None:
        _ip("netns", "add", HUB)
        _ip("-n", HUB, "link", "add", "br0", "type", "bridge")
        _ip("-n", HUB, "link", "set", "br0", "up")
        for node in self.nodes:
            _ip("netns", "add", node.netns)
            port = f"p{node.index}"
            _ip("-n", HUB, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
            _ip("-n", HUB, "link", "set", port, "master", "br0")
            _ip("-n", HUB, "link", "set", port, "up")
            _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", "eth0")
            _ip("-n", node.netns, "link", "set", "eth0", "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
            if self.hosts_files:
                self.hosts_path(node).write_text(f"127.0.0.1 localhost\n127.0.1.1 {node.hostname}\n")

    def hosts_path(self, node: Node) -> Path:
        return self.workdir / f"hosts.{node.hostname}"

    def argv(self, node: Node, cmd: Sequence[str]) -> list[str]:
        """`cmd` as a process on `node`: its network namespace, its host name (and /etc/hosts)."""
        mount = ["--mount"] if self.hosts_files else []
        bind = 'mount --bind "$1" /etc/hosts && ' if self.hosts_files else ""
        script = f'hostname "$0" && {bind}shift && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{node.netns}", "unshare", "--uts", *mount, "sh", "-c", script,
                node.hostname, str(self.hosts_path(node)), *cmd]

    def popen(self, node: Node, cmd: Sequence[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(node, cmd), **kw)

    def run(self, node: Node, cmd: Sequence[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        return subprocess.run(self.argv(node, cmd), text=True, timeout=timeout, **kw)

    def pids(self, node: Node) -> list[int]:
        return _pids(node.netns)


SLURM_CONF = """ClusterName=mamh
SlurmctldHost={ctl}({ctl_addr})
SlurmctldPort=32817
SlurmdPort=32818
SrunPortRange=32830-32899
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=30
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
{nodes}
PartitionName=mamh Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class SlurmOnHosts:
    """A Slurm cluster on `hosts`: slurmctld on node 0 (also the login node that submits), one slurmd per node
    with NodeAddr = the node's address, its own config file (SLURM_CONF) and state under `workdir`; munge
    is the machine's (.ci/slurm_up.sh installs and starts it). The daemons end with the namespaces."""

    def __init__(self, hosts: Hosts, workdir: Path, cpus: int = 4):
        self.hosts, self.dir, self.cpus = hosts, Path(workdir), cpus
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    @property
    def login(self) -> Node:
        return self.hosts.nodes[0]

    def start(self, timeout: float = 120) -> None:
        for sub in ("state", "log", *(f"spool/{n.hostname}" for n in self.hosts.nodes)):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(f"NodeName={n.hostname} NodeAddr={n.address} CPUs={self.cpus} RealMemory=4096 State=UNKNOWN"
                          for n in self.hosts.nodes)
        self.conf.write_text(SLURM_CONF.format(ctl=self.login.hostname, ctl_addr=self.login.address, d=self.dir,
                                               nodes=nodes))
        daemons = [(self.login, "/usr/sbin/slurmctld")] + [(n, "/usr/sbin/slurmd") for n in self.hosts.nodes]
        for node, daemon in daemons:  # each forks into the background and returns
            r = self.hosts.run(node, [daemon, "-f", str(self.conf)], env=self.env, timeout=60)
            if r.returncode != 0:
                raise RuntimeError(f"{daemon} on {node.hostname} failed: {(r.stderr or r.stdout).strip()[-500:]}"
                                   f"\n{self.logs()}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.cmd(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split("\n")
            idle = [s for s in states if s.split()[-1:] and s.split()[-1] in ("idle", "mix", "alloc")]
            if len(idle) == len(self.hosts.nodes):
                return
            time.sleep(1)
        raise RuntimeError(f"Slurm on {len(self.hosts.nodes)} namespaces did not come up in {timeout}s\n{self.logs()}")

    def cmd(self, argv: Sequence[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        """A Slurm client command (sbatch, scontrol, ...) on the login node."""
        return self.hosts.run(self.login, argv, env=self.env, timeout=timeout, **kw)

    def job_state(self, job: str) -> tuple[str, str]:
        out = self.cmd(["scontrol", "show", "job", job]).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return fields.get("JobState", "?"), fields.get("ExitCode", "?")

    def wait_done(self, job: str, timeout: float) -> tuple[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state, code = self.job_state(job)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY"):
                return state, code
            time.sleep(2)
        self.cmd(["scancel", job])
        return self.job_state(job)

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:])
                         for f in sorted((self.dir / "log").glob("*.log")))
