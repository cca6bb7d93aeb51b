"""Process-level communication helpers shared by the trainer and the embedded server (no trainer or
server imports here): free TCP ports, the weight-update process group, and the trainer ranks' agreements
(`agree`, `from_rank0`, `any_rank`, `every_rank`: rank 0 tells everyone, in one place).

`init_custom_process_group` builds a torch process group exactly as SGLang, AReaL, slime and OpenRLHF
do (PyTorch's `init_process_group` without touching the default group): TCP rendezvous at
`tcp://master_address:master_port` (rank 0 hosts the store), a `PrefixStore(group_name)`,
`_new_process_group_helper`, and the group's ranks registered in `_world.pg_group_ranks`. A group
built any other way writes other store keys, and the other side waits until its timeout.
"""
from __future__ import annotations

import datetime
import inspect
import os
import socket
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    """Whether a listener could bind `host:port` now. With SO_REUSEADDR, as servers bind: the connections of a
    process that ended (TIME_WAIT) do not count, another process's listener does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def listens(port: int, pid: int) -> Optional[bool]:
    """Whether process `pid` or one of its descendants holds the listening TCP socket on `port` (any address,
    IPv4 or IPv6), read from /proc; None where this cannot be told (no /proc/net/tcp). A process that only asked
    for a free port may find another one listening there: this tells its own listener from the other's."""
    inodes: set[str] = set()
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{f[9]}]")
    if not readable:
        return None
    if not inodes:
        return False
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:  # the parent pid is the 2nd field after the command's closing parenthesis
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in tree:
            tree.add(p)
            todo.extend(children.get(p, []))
    for p in tree:
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{p}/fd/{fd}") in inodes:
                    return True
            except OSError:
                continue
    return False


PORT_ATTEMPTS = 3  # a process started at a free_port() that another process took meanwhile: tries with a new one


def lost_the_port(log: str) -> bool:
    """A process's output says its listening port was taken (free_port() leaves a window until the process binds
    it, in which another process's listener or outgoing connection can take it)."""
    low = log.lower()
    return any(m in low for m in ("address already in use", "errno 98]", "eaddrinuse",
                                  "port is already in use"))  # SGLang's check of the ports it derives from --port


def output_since(path: Optional[Path], offset: int) -> str:
    """What a process wrote to its log `path` after `offset` (its size when the process started); "" without one."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def is_loopback(host: Optional[str]) -> bool:
    return host in (None, "", "localhost", "::1") or str(host).startswith("127.")


def route_source(peer: str) -> str:
    """This host's address on the route to `peer` (an address or a name): what `peer` reaches this host at.
    A UDP connect() sends nothing; a peer that is this host gives its own address back."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


def interface_of(address: str) -> Optional[str]:
    """The name of the local network interface that holds `address` (None: no interface has it)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def _gloo_hostname_address() -> Optional[str]:
    """The address gloo binds to by default: the first address this host's name resolves to that can be bound
    (as torch's doesHostnameResolveToUsableAddress and gloo's lookup choose), None when there is none."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except OSError:
        return None
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind(addr)
        except OSError:
            continue
        return str(addr[0])
    return None


def pin_gloo_interface(peer: Optional[str]) -> Optional[str]:
    """Before a gloo group with ranks on other hosts: gloo binds to the address of this host's name and falls
    back to loopback when the name does not resolve to a local address (or resolves to 127.0.1.1, as Debian's
    /etc/hosts has it), and then no rank on another host can connect ("connectFullMesh failed ... remote=
    [127.0.0.1]"). In that case, and only then, GLOO_SOCKET_IFNAME is set to the interface on the route to
    `peer` (the rendezvous address). An explicit GLOO_SOCKET_IFNAME and loopback peers are left alone.
    Returns the interface set, else None."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or is_loopback(peer):
        return None
    if not is_loopback(_gloo_hostname_address()):
        return None  # the host name resolves to a local non-loopback address: gloo's own choice works
    try:
        name = interface_of(route_source(str(peer)))
    except OSError:
        return None  # no route to the peer: the rendezvous fails and says so
    if name is None or name == "lo":
        return None
    os.environ["GLOO_SOCKET_IFNAME"] = name
    import logging

    logging.getLogger("mega_async.utils.comm").info(
        "gloo: host name %s does not resolve to an address other hosts reach; GLOO_SOCKET_IFNAME=%s (the interface "
        "on the route to %s)", socket.gethostname(), name, peer)
    return name


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: Optional[datetime.timedelta] = None) -> Any:
    """A process group of `world_size` ranks next to (and independent of) the default group.

    Both sides of a weight-update group call this: the trainer as rank 0 (it hosts the TCP store),
    each inference server rank at `rank_offset + tp_rank`. Returns the group for
    `torch.distributed.broadcast(t, src=0, group=pg)`.
    """
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                    default_pg_timeout, rendezvous)

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    if not group_name:
        raise ValueError("group_name must be a non-empty string")
    timeout = timeout or default_pg_timeout
    if backend == "gloo":  # ranks of this group on other hosts must reach this one's gloo address
        pin_gloo_interface(urlparse(init_method).hostname)
    # under torchrun, TORCHELASTIC_USE_AGENT_STORE makes every rendezvous a client of the agent's store;
    # this group's rank 0 must host its own store at init_method instead
    agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    finally:
        if agent_store is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent_store
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # the options argument was renamed from pg_options to backend_options in PyTorch 2.6
    opt = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters \
        else "pg_options"
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout, **{opt: None})
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_custom_process_group(pg: Any) -> None:
    """Tear down a group made by `init_custom_process_group` (the default group is untouched)."""
    import torch.distributed as dist

    if pg is not None:
        dist.destroy_process_group(pg)


# ---- rank 0 tells everyone: the one home of the trainer ranks' small agreements (over a gloo control group) -----
def rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def one_line(error: Optional[str]) -> Optional[str]:
    return " ".join(error.split()) if error else error


def agree(error: Optional[str], group: Any = None) -> list[str]:
    """Every rank's error (None = fine, each flattened to one line), gathered on every rank."""
    error = one_line(error)
    if _world() == 1:
        return [error] if error else []
    return [f"rank {r}: {e}" for r, e in enumerate(every_rank(error, group)) if e]


def every_rank(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if _world() == 1:
        return [obj]
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj, group=group)
    return every


def from_rank0(obj: Any, group: Any = None) -> Any:
    """Rank 0's `obj` on every rank (over `group`, e.g. the gloo control group)."""
    if _world() == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def any_rank(flag: bool, group: Any = None) -> bool:
    """True on every rank when `flag` is true on any."""
    if _world() == 1:
        return flag
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
