"""Weights over a torch.distributed group with the servers (SGLang's update_weights_from_distributed): each pipeline
stage head streams its stage's resharded buckets; FP8 block quantization on the way when the card is FP8.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import logging
import socket
import threading
import time
from typing import Any, Callable, Iterator, Optional, Sequence
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from mega_async.inference.client import join_grace
from mega_async.trainer.sync.bracket import SyncContext, Transport, WeightSync
from mega_async.trainer.sync.common import (SLACK_S, PhaseTimeout, RolloutSide, SyncError, fp8_block_of,
                                             future_result)
from mega_async.utils.comm import agree, every_rank, from_rank0, rank
from mega_async.trainer.sync.verify import aligned_order, num_experts_of
from mega_async.api.types import WeightVersion

logger = logging.getLogger("mega_async.trainer.sync")


DATA_PLANES = ("broadcast", "none")  # distributed_sync(data_plane=...): none = the fleet benchmark's seam
NO_DATA_PLANE = object()  # the weight-update "group" of data_plane="none": nothing is joined
# a bucket that no server answered and whose broadcast has not completed after this many times the slowest bucket so
# far, and at least STUCK_MIN_S (a loaded 2-core machine stalls a healthy server for seconds), is not being received:
# the servers of the group are named and taken out
STUCK_FACTOR = 4.0
STUCK_MIN_S = 10.0


# every sync's abandoned broadcasts: their gloo threads wait inside the broadcast until the group's timeout
# (trainer.sync_timeout), and a process ending normally joins those threads in the group's destructor
ABANDONED: list[list] = []


def broadcasts_abandoned() -> bool:
    """Whether this process gave up on a weight broadcast its receivers never joined: it then ends with os._exit
    once everything else is closed (mega_async.cli), instead of waiting out trainer.sync_timeout at exit."""
    return any(ABANDONED)


def _fp8_bucket(bucket: Any, block: tuple[int, int], resharder: Any) -> Any:
    """The bucket as an FP8 block checkpoint holds it (each weight with its weight_scale_inv, in one bucket)."""
    from mega_async.bridge import fp8
    from mega_async.trainer.weights import Bucket

    out = Bucket()
    skip = fp8.skipped_modules(resharder.bridge.hf_config)
    for name, t in fp8.quantize_named(zip(bucket.names, bucket.tensors), block, skip):
        out.add(name, t)
    return out


def _reachable_address(server_addresses: Sequence[str]) -> str:
    """The local address the servers can reach this host at (the route to the first server)."""
    host = urlparse(server_addresses[0] if "://" in server_addresses[0] else f"http://{server_addresses[0]}").hostname
    if host in (None, "localhost") or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # connect() on UDP sends nothing
        s.connect((host, 9))
        return s.getsockname()[0]


class BroadcastTransport(Transport):
    """Weights by torch.distributed broadcast: each pipeline stage head owns a weight-update group with
    every server rank (trainer = rank 0, server i at 1 + its GPUs before it), built as SGLang builds it;
    per bucket it POSTs /update_weights_from_distributed from the HTTP thread, broadcasts, and checks
    every reply. A server back behind the synced version is brought up to date between steps (the bracket's
    `catch_up`, over a group of its own: `rebuild`)."""

    catches_up = True

    def __init__(self, addresses: Sequence[str], *, api_key: Optional[str] = None, bucket_bytes: int = 512 << 20,
                 load_format: str = "flattened_bucket", backend: Optional[str] = None, gpus_per_server: int = 1,
                 master_address: Optional[str] = None, weight_format: str = "model_dtype",
                 data_plane: str = "broadcast"):
        if data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane={data_plane!r}: use broadcast (none: the simulated fleet's control-plane "
                             "benchmark, never a run)")
        if load_format not in ("flattened_bucket", "tensor"):
            raise ValueError(f"load_format={load_format!r}: use flattened_bucket or tensor")
        self.addresses = list(addresses)
        self.api_key = api_key
        self.bucket_bytes = bucket_bytes
        self.data_plane = data_plane  # a constructor seam for tools/bench_scale.py and tests; no config key sets it
        self.load_format = load_format
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.gpus_per_server = gpus_per_server
        self.master_address = master_address
        self.weight_format = weight_format
        self.client: Any = None
        self.pg: Any = None
        self._init_error: Optional[str] = None
        self._abandoned: list = []  # broadcasts given up on (a server refused): kept alive, never waited for
        self._fleet_checked: set[str] = set()  # data_plane="none": servers checked to be simulated ones
        self._moved: dict[str, str] = {}  # rank 0's client's moved servers, as rank 0 last sent them
        self._group_on_servers = False  # the servers were told of a group this side has left
        self._slowest_bucket: Optional[float] = None  # the longest a bucket took so far (broadcast and replies)
        self._broadcasts = 0  # broadcasts started on the current group (a receiver reports how many it completed)
        # rank 0: servers that came back behind, each with the future its recovery waits on (catch_up sets it)
        self._due: dict[str, concurrent.futures.Future] = {}
        self._due_lock = threading.Lock()

    def open(self, ctx: SyncContext) -> None:
        from mega_async.trainer.weights import Resharder

        super().open(ctx)
        self.fp8_block = fp8_block_of(ctx.models, self.weight_format)
        self.num_experts = num_experts_of(ctx.models)
        self.resharder = Resharder(ctx.models, bucket_bytes=self.bucket_bytes)
        self.group_name = f"mega_async_pp{self.resharder.pp_rank}"
        ABANDONED.append(self._abandoned)  # the process's exit must not wait on them (`broadcasts_abandoned`)
        addresses = self.addresses
        if self.resharder.is_stage_head:
            try:
                from mega_async.inference.client import SGLangClient

                if not addresses:
                    raise ValueError("no server addresses: the distributed sync needs inference servers")
                self.client = ctx.rollout.client if ctx.rollout is not None else SGLangClient(
                    list(addresses), api_key=self.api_key, request_timeout=ctx.timeout)
                if ctx.servers is not None:  # each server's protocol, once (sessions since SGLang 0.5.21)
                    releases = ctx.servers.releases()
                    logger.info("servers' SGLang releases: %s", ", ".join(
                        f"{a} {r.version or '?'}{' (sessions)' if r.sessions else ''}" if r is not None else
                        f"{a} down (asked before its first update)" for a, r in zip(self.client.addresses, releases)))
                self._master_address = self.master_address or _reachable_address(addresses)
                if ctx.rollout is not None:  # a server back behind waits for the trainer's catch_up
                    self.client.recover = self._await_catch_up
            except Exception as e:  # noqa: BLE001 - agreed below, so no rank is left waiting
                self._init_error = f"{type(e).__name__}: {e}"
        # pipeline stages stream one after another: concurrent groups through the same servers could
        # interleave their broadcasts differently on different servers and deadlock (NCCL rings)
        heads = [(self.resharder.pp_rank, rank())] if self.resharder.is_stage_head else []
        heads = [h for x in every_rank(heads, ctx.group) for h in x]
        self._stage_heads = dict(heads)
        self._first_group()

    def _first_group(self) -> None:
        """Every rank, at construction: rank 0 names the members (the servers up now; one down at start joins a
        later sync) and every stage head builds its group. A member lost meanwhile leaves it to the first push."""
        early = agree(self._init_error, self.ctx.group)  # the client, the releases, the address: no group to build
        if early:
            self.close()
            raise SyncError("could not build the weight-update groups: " + "; ".join(early))
        members = self._decide_members(lambda: [s.address for s in self.client.sync_targets()])
        if self.resharder.is_stage_head:
            try:
                if not members and self.ctx.rollout is not None:
                    raise ValueError("no inference server is up to take the weights; check the servers' logs")
                self._init_group(self._master_address, members)
            except Exception as e:  # noqa: BLE001 - agreed below
                self._init_error = f"{type(e).__name__}: {e}"
        errors = agree(self._init_error, self.ctx.group)
        lost = self.ctx.decide(lambda: [a for a in members or () if a not in {
            s.address for s in self.client.sync_targets()}]) if errors else None
        if errors and lost:  # a member went down while the group was built: the first push builds it again
            if self.ctx.rollout is not None:
                logger.warning("server(s) %s went down while the weight-update group was built; the first push "
                               "builds it again without them", ", ".join(lost))
            self.abort()
            errors = []
        if errors:
            self.close()
            raise SyncError("could not build the weight-update groups: " + "; ".join(errors))

    def _decide_members(self, decision: Callable[[], Optional[list[str]]]) -> Optional[list[str]]:
        """One decision: rank 0's group members (`decision()`; None: no group to build) on every rank, with its
        client's moved servers (first address -> current one), which a later stage head applies before it adopts
        the members."""
        def with_moved() -> tuple[Optional[list[str]], dict[str, str]]:
            members = decision()
            return members, dict(getattr(self.client, "moved", {})) if members is not None else {}

        members, self._moved = self.ctx.decide(with_moved)
        return members

    def members(self) -> None:
        """Every rank, before a push: rank 0 decides whether the weight-update groups must be built again (a
        member is down, a server came back with a new process or behind, or a failed sync dropped the group),
        and every stage head rebuilds its group over the servers to sync now."""
        def changed() -> Optional[list[str]]:  # rank 0: the servers to build the groups over, or None
            targets = self.client.sync_targets()
            addrs = [s.address for s in targets]
            if self.pg is None or addrs != self.client.group_members or any(s.rejoin for s in targets):
                return addrs
            return None

        want = self._decide_members(changed)
        if want is None:
            return
        if not want:
            raise SyncError("no inference server is up to take the weights; check the servers' logs")
        if self.ctx.rollout is not None:
            logger.warning("weight-update groups built again over %d server(s) (members: %s)", len(want),
                           ", ".join(want))
        self.rebuild(want)

    def rebuild(self, want: list[str]) -> None:
        """Every rank: every stage head builds its weight-update group again over the servers `want`."""
        self._init_error = None
        if self.resharder.is_stage_head:
            try:
                self._destroy_group()
                self._init_group(self._master_address, want)
            except Exception as e:  # noqa: BLE001 - agreed below
                self._init_error = f"{type(e).__name__}: {e}"
        errors = agree(self._init_error, self.ctx.group)
        if errors:
            raise SyncError("could not build the weight-update groups again: " + "; ".join(errors))

    # ---- a server back behind: the trainer brings it to the current version ---------------------
    async def _await_catch_up(self, address: str) -> None:
        """The client's `recover` hook (rank 0): a server that came back behind the synced version (a restarted
        process at its launch weights, or one down during a sync) waits here until every trainer rank broadcast
        the current version into it (`catch_up`, while rank 0 waits for a step's groups) or a push included it.
        Only the trainer holds the current weights (there is no directory to load), so nothing else can: with
        one server and no hook the run waited for groups no server could generate."""
        with self._due_lock:
            fut = self._due.get(address)
            if fut is None or fut.done():
                fut = self._due[address] = concurrent.futures.Future()
        await asyncio.wrap_future(fut)

    def settle(self, addresses: Optional[Sequence[str]] = None) -> None:
        """Rank 0: the recoveries waiting on `addresses` (None: all) end; the client probes those servers again
        (admitted at the current version, or behind again: then it asks again)."""
        with self._due_lock:
            for a in list(self._due) if addresses is None else [a for a in addresses if a in self._due]:
                fut = self._due.pop(a)
                if not fut.done():
                    fut.set_result(None)

    def waiting(self) -> bool:
        return bool(self._due)

    def due(self) -> Optional[list[str]]:
        """Rank 0: the servers waiting for a catch-up that are still behind (the others are let go: admitted
        meanwhile, or down again)."""
        with self._due_lock:
            wanted = list(self._due)
        behind = {s.address for s in self.client.sync_targets() if s.behind}
        self.settle([a for a in wanted if a not in behind])
        return [a for a in wanted if a in behind]

    @contextlib.contextmanager
    def pushing(self) -> Iterator[None]:
        try:
            yield
        finally:
            if self.ctx.rollout is not None:  # the servers it included are at its version (or it failed: ask again)
                self.settle()

    def _init_group(self, address: str, addresses: Optional[list[str]] = None) -> None:
        from mega_async.utils.comm import free_port, init_custom_process_group

        port = free_port()
        self.group_name = f"mega_async_pp{self.resharder.pp_rank}_{port}"  # unique per run and stage
        self._broadcasts = 0
        if addresses is None:
            addresses = [s.address for s in self.client.sync_targets()]
        elif self.ctx.rollout is None:  # a later stage's head: rank 0 names the members, one may have moved meanwhile
            self.client.adopt(addresses, moved=self._moved)
        if self.data_plane == "none":
            return self._init_control_plane_only(address, port, addresses)
        fut = self.ctx.loop.submit(self.client.init_weights_update_group(
            address, port, self.group_name, backend=self.backend, gpus_per_server=self.gpus_per_server,
            timeout=self.ctx.timeout, addresses=addresses))
        world = 1 + self.gpus_per_server * len(addresses)
        try:
            self.pg = init_custom_process_group(self.backend, f"tcp://{address}:{port}", world, 0, self.group_name,
                                                timeout=datetime.timedelta(seconds=self.ctx.timeout))
            future_result(fut, self.ctx.timeout + SLACK_S, f"the servers joining weight-update group {self.group_name}")
            logger.info("weight-update group %s: trainer + %d server ranks at %s:%d (%s)", self.group_name,
                        world - 1, address, port, self.backend)
        except Exception as e:  # noqa: BLE001
            self._init_error = f"{self.group_name}: {type(e).__name__}: {e}"
            fut.cancel()
            self.abort()  # no half-built group: the next push builds one again

    def _init_control_plane_only(self, address: str, port: int, addresses: Optional[list[str]] = None) -> None:
        """data_plane="none": the servers are told of a group nobody joins and no tensor moves. Only simulated fleet
        servers that say so in /server_info take part (a real server would wait for a broadcast)."""
        unchecked = [a for a in addresses or self.client.addresses if a not in self._fleet_checked]
        if unchecked:  # once per server (a member the first time it joins): the same process kind after
            infos = self.ctx.servers.server_info(unchecked)
            real = [a for a, i in zip(unchecked, infos) if (i.get("fleet") or {}).get("data_plane") != "none"]
            if real:
                raise ValueError(f"data_plane='none' needs simulated fleet servers without a data plane; {real[0]} "
                                 "has one: use the default data_plane='broadcast'")
            self._fleet_checked.update(unchecked)
        self.ctx.servers.call(self.client.init_weights_update_group(address, port, self.group_name, backend=self.backend,
                                                                gpus_per_server=self.gpus_per_server,
                                                                timeout=self.ctx.timeout, addresses=addresses),
                          "/init_weights_update_group")
        self.pg = NO_DATA_PLANE

    def update(self, target: int) -> Optional[str]:
        """Stream this stage's buckets; bucket k is broadcast and loaded while bucket k+1 is gathered (at most
        two buckets in flight, the next POST only after the previous reply, so servers see them in order)."""
        error: Optional[str] = None
        stats = {"bytes": 0, "buckets": 0, "broadcast_s": 0.0, "server_s": 0.0, "bucket_s": 0.0}
        t_all = time.perf_counter()
        rs = self.resharder
        turn = rs.is_stage_head and rs.pp_size > 1
        if turn and rs.pp_rank > 0:  # wait for the previous stage; it says whether it failed
            token = torch.zeros(1, dtype=torch.int64)
            dist.recv(token, src=self._stage_heads[rs.pp_rank - 1], group=self.ctx.group)
            if token.item():
                error = f"stage {rs.pp_rank - 1} failed first; stage {rs.pp_rank} sent nothing"
        if error is None and rs.is_stage_head and self.pg is None:  # dropped by an earlier failed sync
            error = (f"stage {rs.pp_rank} has no weight-update group (building it failed); check the servers' "
                     "logs")
        try:
            error = self._stream(target, stats, error)
        finally:
            if turn and rs.pp_rank < rs.pp_size - 1:
                token = torch.tensor([1 if error else 0], dtype=torch.int64)
                dist.send(token, dst=self._stage_heads[rs.pp_rank + 1], group=self.ctx.group)
        stats["gather_s"] = rs.stats.get("gather_s", 0.0)
        stats["total_s"] = time.perf_counter() - t_all
        self.figures = {f"sync/{k}": float(v) for k, v in stats.items()}
        return error

    def _stream(self, target: int, stats: dict, error: Optional[str]) -> Optional[str]:
        """Each error names its bucket (`bucket <k> of stage <s>`) and, through the client, the server."""
        pending = None
        where = ""
        for k, bucket in enumerate(self.resharder.buckets()):  # every rank of the stage drains it (collectives)
            if error is not None or self.pg is None:
                continue  # keep draining so the stage's other ranks are not left in a gather
            bucket = self._for_servers(bucket)
            if not len(bucket):
                continue
            try:
                if pending is not None:
                    self._finish(pending, stats)
                    pending = None
                where = f"bucket {k} of stage {self.resharder.pp_rank}"
                pending = self._start(bucket if self.fp8_block is None else _fp8_bucket(bucket, self.fp8_block,
                                                                                         self.resharder), target, stats)
                pending = (*pending, where)
            except Exception as e:  # noqa: BLE001
                error, pending = f"{pending[-1] if pending else where}: {type(e).__name__}: {e}", None
        if pending is not None and error is None:
            try:
                self._finish(pending, stats)
            except Exception as e:  # noqa: BLE001
                error = f"{pending[-1]}: {type(e).__name__}: {e}"
        return error

    def commit(self, target: int) -> Optional[str]:
        """Every stage streamed: an empty update sets the new version on the servers (SGLang sets
        weight_version only on success), so a failed sync never leaves a server claiming the new one. It also
        flushes the cache, once per sync (the buckets do not: the servers are paused in between). A server lost
        since the last bucket (down, or restarted) is left out instead of failing the others."""
        if self.ctx.servers is not None and self.pg is not None:
            lost = self.ctx.servers.call(self.client.commit_distributed(self.group_name, target,
                                                                    flush_cache=self.ctx.flush_cache,
                                                                    timeout=self.ctx.timeout), "commit")
            if lost:  # every bucket reached them before; they come back behind and are brought up to date
                logger.warning("server(s) %s went down during the commit of version %d; the others serve it",
                               ", ".join(lost), target)
        return None

    def begin(self, target: int) -> Optional[str]:
        """Rank 0 opens a weight-update session on every server whose release needs one (SGLang 0.5.21+:
        distributed updates outside one are refused), before any stage streams its first bucket, and decides
        whether the model's MTP layers go to these servers (every stage head hears it)."""
        error, plan = None, (False, None)
        if self.ctx.servers is not None and self.pg is not None:
            try:
                self.ctx.servers.call(self.client.begin_weight_update(timeout=self.ctx.timeout), "begin_weight_update")
                if self.resharder.bridge.mtp_layers:
                    plan = self.client.mtp_plan()
            except Exception as e:  # noqa: BLE001 - every rank hears rank 0's plan below first
                error = f"begin_weight_update: {type(e).__name__}: {e}"
        send, why = from_rank0(plan, self.ctx.group)
        self._send_mtp = bool(send)
        return error or why

    def _for_servers(self, bucket: Any) -> Any:
        """The bucket without the MTP layers' tensors when the servers keep no draft (they get the target only)."""
        if getattr(self, "_send_mtp", False) or not self.resharder.bridge.mtp_layers:
            return bucket
        from mega_async.bridge.mtp import is_mtp_hf_name
        from mega_async.trainer.weights import Bucket

        layers = self.resharder.bridge.num_layers
        out = Bucket()
        for name, t in zip(bucket.names, bucket.tensors):
            if not is_mtp_hf_name(name, layers):
                out.add(name, t)
        return out

    def end(self, target: int) -> Optional[str]:
        if self.ctx.servers is not None and self.client is not None:
            self.ctx.servers.call(self.client.end_weight_update(timeout=self.ctx.timeout), "end_weight_update")
        return None

    def end_quietly(self) -> None:
        if self.ctx.servers is None or self.client is None:
            return
        try:
            self.ctx.servers.call(self.client.end_weight_update(check=False, timeout=self.ctx.timeout),
                              "closing the weight-update sessions")
        except Exception as e:  # noqa: BLE001 - the sync has failed already; this must not hide why
            logger.warning("closing the servers' weight-update sessions failed: %s: %s", type(e).__name__, e)
        if self.client.sessions_open:
            logger.warning("servers %s may still have a weight-update session open (unreachable); the next "
                           "sync closes and reopens it", ", ".join(self.client.sessions_open))

    def _start(self, bucket: Any, target: int, stats: dict) -> tuple:
        """POST the bucket (HTTP thread), then start its broadcast(s) without waiting."""
        t0 = time.perf_counter()
        dev = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        order = list(range(len(bucket.names)))
        if self.load_format == "flattened_bucket":
            order = aligned_order(bucket.tensors)
        if self.pg is NO_DATA_PLANE:
            payload = []  # data_plane="none": only the control messages
        elif self.load_format == "flattened_bucket":
            payload = [torch.cat([bucket.tensors[i].reshape(-1).view(torch.uint8) for i in order]).to(dev)]
        else:
            payload = [t.to(dev) for t in bucket.tensors]
        fmt = "flattened_bucket" if self.load_format == "flattened_bucket" else None
        fut = self.ctx.loop.submit(self.client.update_weights_from_distributed(  # the version comes in _commit
            [bucket.names[i] for i in order], [bucket.dtypes[i] for i in order], [bucket.shapes[i] for i in order],
            self.group_name, load_format=fmt, timeout=self.ctx.timeout, flush_cache=False))  # the commit flushes once
        works = [dist.broadcast(t, src=0, group=self.pg, async_op=True) for t in payload]
        self._broadcasts += len(payload)
        stats["bucket_s"] += time.perf_counter() - t0
        stats["bytes"] += bucket.nbytes
        stats["buckets"] += 1
        return works, fut, payload, bucket, t0

    def _finish(self, pending: tuple, stats: dict) -> None:
        """Wait for a bucket's broadcasts while watching the servers' replies, then for every reply.

        A server that refuses the bucket (400) answers without joining the broadcast, which then cannot
        complete: its refusal ends the wait at once (the broadcast is abandoned, the group dropped by the
        failure path), instead of after `trainer.sync_timeout`. A server that has not answered `join_grace` after
        another one did is not receiving (the client names it and takes it out); one that hangs gives no reply
        within `trainer.sync_timeout` (the POST's own timeout). When every server answered 200 and the broadcast
        is still not complete `join_grace` later, some server acknowledged the bucket without receiving it: the
        servers whose /weights_checker shows none of the bucket's tensors are named and taken out."""
        works, fut, payload, bucket, started = pending[:5]  # the payload must live until the broadcast is done
        t0 = time.perf_counter()
        answered_at = None
        stuck_after = None if self._slowest_bucket is None else max(STUCK_MIN_S, STUCK_FACTOR * self._slowest_bucket)
        nap = 2e-4
        while not all(w.is_completed() for w in works):
            if fut.done() and not fut.cancelled() and fut.exception() is not None:
                self._abandoned.append((works, payload, self.pg))  # gloo may still be sending from these
                raise SyncError(f"{fut.exception()} (the bucket's broadcast was abandoned)")
            if fut.done() and answered_at is None:
                answered_at = time.perf_counter()
            if answered_at is not None and time.perf_counter() > answered_at + join_grace(answered_at - t0):
                self._abandoned.append((works, payload, self.pg))
                raise SyncError(self._acknowledged_without_receiving(bucket, time.perf_counter() - answered_at))
            if (answered_at is None and stuck_after is not None and not self.client.bucket_answered
                    and time.perf_counter() > started + stuck_after):
                fut.cancel()  # no server answered and nothing moves, where earlier buckets took at most a fraction
                self._abandoned.append((works, payload, self.pg))
                raise SyncError(self._not_receiving(time.perf_counter() - started))
            # while replies are due, the POST's own timeout (which names the server) comes first
            answered = fut.done()
            if time.perf_counter() > t0 + self.ctx.timeout + (0.0 if answered else SLACK_S):
                fut.cancel()
                self._abandoned.append((works, payload, self.pg))
                members = ", ".join(self.client.group_members)
                raise PhaseTimeout(f"the broadcast did not complete within trainer.sync_timeout={self.ctx.timeout:g}s "
                                   f"although {members} answered" if answered else
                                   f"neither the broadcast nor the replies of {members} finished within "
                                   f"{self.ctx.timeout + SLACK_S:g}s (trainer.sync_timeout={self.ctx.timeout:g})")
            concurrent.futures.wait([fut], timeout=nap)  # wakes at once when a reply arrives
            nap = min(2 * nap, 5e-3)
        try:
            for w in works:
                w.wait()
        except Exception as e:
            try:  # a server's own answer (refused, 400) says more than the broken broadcast
                fut.result(1.0)
            except concurrent.futures.TimeoutError:
                fut.cancel()
            except Exception as http:  # noqa: BLE001
                raise SyncError(f"{http} (broadcast: {type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
            raise
        t1 = time.perf_counter()
        future_result(fut, self.ctx.timeout + SLACK_S, "the servers' replies to /update_weights_from_distributed")
        took = time.perf_counter() - started
        self._slowest_bucket = took if self._slowest_bucket is None else max(self._slowest_bucket, took)
        stats["broadcast_s"] += t1 - t0
        stats["server_s"] += time.perf_counter() - t1

    def _not_receiving(self, waited: float) -> str:
        """No server of the group answered a bucket nor completed its broadcast in `waited` seconds, STUCK_FACTOR
        times the slowest bucket so far: the group's servers are not receiving it (their calls still pending). They
        are taken out (back when they answer again, behind) and named."""
        members = list(self.client.group_members)
        for address in members:
            self.client.mark_silent(address, f"/update_weights_from_distributed: no answer and no broadcast progress "
                                             f"in {waited:.1f}s")
        return (f"{', '.join(members)} did not receive the bucket: no answer to /update_weights_from_distributed "
                f"and the broadcast not complete after {waited:.1f}s, where every bucket so far took at most "
                f"{self._slowest_bucket:.2f}s (the call still pending; the broadcast was abandoned)")

    def _acknowledged_without_receiving(self, bucket: Any, waited: float) -> str:
        """Every server answered 200 to a bucket whose broadcast has not completed: name those that did not receive
        it. A server that did holds the bucket's tensors now (under some dtype and hash, `learn_flavor`); one whose
        /weights_checker shows none of them did not, and is taken out. With one server, that one."""
        from mega_async.trainer.sync.digest import holds

        members = list(self.client.group_members)
        missed = members if len(members) == 1 else []
        if len(members) > 1:
            try:
                replies = self.ctx.loop.run(self.client.weights_checksums(self.ctx.timeout, members),
                                         self.ctx.timeout + SLACK_S, "/weights_checker")
                named = list(zip(bucket.names, bucket.tensors))
                for address, reply in zip(members, replies):
                    sums = {n: c for r in (reply or {}).get("ranks") or [] for n, c in (r.get("checksums") or {}).items()}
                    if holds(sums, named, self.num_experts) is False:
                        missed.append(address)
            except Exception as e:  # noqa: BLE001 - then every member is a suspect
                logger.warning("asking the servers which of them received the bucket failed: %s: %s",
                               type(e).__name__, e)
        if len(members) > 1 and not missed:  # the weights did not change (or every member looks alike): a server
            missed = self._behind_on_broadcasts(members)  # that counts its receives says whether it had this one
        for address in missed:
            self.client.mark_silent(address, "/update_weights_from_distributed: acknowledged a bucket without "
                                             "receiving its broadcast")
        who = ", ".join(missed) if missed else f"one of {', '.join(members)} (could not tell which)"
        return (f"{who} answered 200 to /update_weights_from_distributed but did not receive the bucket's broadcast "
                f"({waited:.1f}s after every server answered it was still not complete; the broadcast was abandoned)")

    def _behind_on_broadcasts(self, members: list[str]) -> list[str]:
        """The members that report fewer completed broadcasts on this group than the trainer started (the embedded
        server counts them in /server_info; a server that reports no count, as SGLang, is not named by this)."""
        try:
            infos = self.ctx.servers.server_info(members) if self.ctx.servers is not None else self.ctx.loop.run(
                self.client.server_info(self.ctx.timeout, members), self.ctx.timeout + SLACK_S, "/server_info")
        except Exception as e:  # noqa: BLE001
            logger.warning("asking the servers how many broadcasts they received failed: %s: %s", type(e).__name__, e)
            return []
        behind = []
        for address, info in zip(members, infos):
            got = ((info or {}).get("weight_update_groups") or {}).get(self.group_name, {}).get("broadcasts_received")
            if isinstance(got, int) and not isinstance(got, bool) and got < self._broadcasts:
                behind.append(address)
        return behind

    def abort(self) -> None:
        if self.pg is not None:  # closing our end makes the servers' pending receives fail at once
            from mega_async.utils.comm import destroy_custom_process_group

            with contextlib.suppress(Exception):
                if self.pg is not NO_DATA_PLANE:
                    destroy_custom_process_group(self.pg)
            self.pg = None
            self._group_on_servers = True

    def after_failure(self) -> None:
        self._destroy_group()

    def _destroy_group(self) -> None:
        had = self.pg is not None or self._group_on_servers
        self.abort()
        if had and self.client is not None:
            with contextlib.suppress(Exception):
                self.ctx.loop.run(self.client.destroy_weights_update_group(self.group_name, timeout=self.ctx.timeout),
                               self.ctx.timeout + SLACK_S, "/destroy_weights_update_group")
            self._group_on_servers = False

    def close(self) -> None:
        if self.ctx.rollout is not None:
            self.settle()
        self._destroy_group()


def distributed_sync(models: Sequence[torch.nn.Module], version: WeightVersion, rollout: Optional[RolloutSide],
                     addresses: Sequence[str], *, api_key: Optional[str] = None, bucket_bytes: int = 512 << 20,
                     load_format: str = "flattened_bucket", backend: Optional[str] = None, gpus_per_server: int = 1,
                     master_address: Optional[str] = None, weight_format: str = "model_dtype",
                     data_plane: str = "broadcast", **kw: Any) -> WeightSync:
    """The sync by broadcast into the servers at `addresses` (`kw`: WeightSync's: timeout, verify, group, events,
    interrupt, ...)."""
    transport = BroadcastTransport(addresses, api_key=api_key, bucket_bytes=bucket_bytes, load_format=load_format,
                                   backend=backend, gpus_per_server=gpus_per_server, master_address=master_address,
                                   weight_format=weight_format, data_plane=data_plane)
    return WeightSync(models, version, rollout, transport, **kw)
