"""SGLangClient: the rollout layer's view of one or more SGLang-protocol servers (real or embedded).

agenerate: send /generate -> append tokens, logprobs, versions -> on abort with budget left,
wait while paused, resubmit prompt + tokens so far (AReaL's interruption loop).
Servers are picked by fewest in-flight requests, sticky per request id. Connection errors are retried
with backoff: the server is marked unhealthy, its requests rerouted, and it is re-admitted once /health
answers again and it serves the weights this client last synced (a restarted process has its launch weights,
one that was down missed a sync: it stays out, `recover` brings it up to date, and the weight syncs include
it). A server that answers 5xx more than `max_retries` times in a row is dropped for good (its
/health may still answer); a busy one (429, or 503: SGLang's full queue, a server's bound on bodies in memory) is
not a failing one: the request waits its Retry-After (else a growing backoff), goes to the least loaded server
again, and fails in one line only after `request_timeout` seconds of busy answers; one whose /model_info fails too
is down as a whole and taken out until it answers (never dropped for good). 401/403, a request over the context
length, and no usable server within `unhealthy_timeout` raise `FatalEngineError`: retrying cannot fix them.
"""
from __future__ import annotations

import asyncio
import codecs
import collections
import dataclasses
import contextlib
import datetime
import email.utils
import errno
import heapq
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

import aiohttp
from yarl import URL

try:  # SGLang speaks orjson; it is several times faster than json both ways (the same numbers)
    from orjson import dumps as _orjson_dumps
    from orjson import loads as _loads

    def _dumps(body: Any) -> bytes:
        try:
            return _orjson_dumps(body)
        except TypeError:  # what orjson does not take (ints beyond 64 bits, ...)
            return json.dumps(body).encode()
except ImportError:  # pragma: no cover - optional
    _loads = json.loads

    def _dumps(body: Any) -> bytes:
        return json.dumps(body, separators=(",", ":")).encode()

from mega_async.utils.events import NullEventLog
from mega_async.api.sglang_releases import (BEGIN_TWICE, END_WITHOUT_BEGIN, Release, mtp_plan, serves_draft,
                                                   session_refusal, untested_reason)
from mega_async.api.types import FatalEngineError, ModelRequest, ModelResponse, Version, WeightVersion

logger = logging.getLogger("mega_async.inference.client")


class NoHealthyServerError(FatalEngineError):
    """No server could take a request within `unhealthy_timeout` (or every server was dropped)."""


class ServerError(RuntimeError):
    """A server answered a request or a control call with an error."""


class FatalServerError(ServerError, FatalEngineError):
    """A server's answer that no retry can change: 401/403, or a request longer than the model's context."""


class ServerTimeout(TimeoutError):
    """A server gave no answer to one call within its timeout. Its message names the server, the route and the
    limit (asyncio's and aiohttp's own timeouts say nothing: `TimeoutError: ` with an empty message)."""

    def __init__(self, address: str, path: str, seconds: float):
        super().__init__(f"{address}{path} gave no answer within {seconds:g}s")
        self.address, self.path, self.seconds = address, path, seconds

    def __reduce__(self) -> tuple:  # picklable (its arguments are not its message)
        return type(self), (self.address, self.path, self.seconds)


class ServerHung(ConnectionError):
    """A /generate cut short because its server was found hung (it gave no answer to another call within its
    timeout): the request goes to another server at once, as it would from a dead one, instead of waiting out
    `request_timeout` for an answer that is not coming."""


def _why(e: BaseException) -> str:
    """One failed call, for a line that already names the server: a timeout says how long it waited."""
    if isinstance(e, ServerTimeout):
        return f"no answer within {e.seconds:g}s"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _failed(s: "_Server", path: str, e: BaseException) -> str:
    """'<server><path> failed: <why>' for an error raised to the caller."""
    return str(e) if isinstance(e, ServerTimeout) else f"{s.address}{path} failed: {_why(e)}"


def _error_message(body: Any) -> str:
    """The message of an SGLang / OpenAI-style error body ({"error": {"message"}}, {"message"}, {"detail"} or text)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(body.get("message") or err or body.get("detail") or body)
    return str(body).strip()


def classify_status(address: str, path: str, status: int, body: Any) -> ServerError:
    """The error for a non-200, non-5xx answer: fatal when retrying cannot help."""
    msg = _error_message(body)
    if status in (401, 403):
        return FatalServerError(f"{address}{path} answered {status} ({msg}): the API key is missing or wrong; "
                                "export it in the variable named by inference.api_key_env")
    if status == 400 and "context length" in msg.lower():
        return FatalServerError(f"{address}{path} answered 400: {msg}; lower rollout.max_new_tokens or "
                                "data.max_prompt_tokens")
    return ServerError(f"{address}{path} answered {status}: {msg}")


BUSY = (429, 503)  # answers that say "busy, come back later" (SGLang's full queue is 503), not "failing"
BUSY_WAIT_MAX_S = 30.0  # the longest one busy answer makes a request wait, whatever its Retry-After says


def _retry_after(value: Optional[str]) -> Optional[float]:
    """A Retry-After header's delay in seconds (RFC 9110: delay-seconds or an HTTP date), None when absent or
    unreadable (a hostile or broken value never makes a request wait past BUSY_WAIT_MAX_S: the caller bounds it)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(min(int(value[:20]), 10 ** 6))  # (20 digits: any longer is past the bound anyway)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())


@dataclass
class _Server:
    address: str
    healthy: bool = True
    in_flight: int = 0
    last_probe: float = 0.0
    failures: int = field(default=0)  # 5xx answers in a row
    dropped: Optional[str] = None  # why it was dropped for good (kept answering 5xx)
    down: str = ""  # why it was last taken out of generation (it may be back since)
    release: Optional[Release] = None  # its SGLang release's weight-sync protocol, learned once
    session_open: bool = False  # a weight-update session (SGLang 0.5.21+) we opened and have not closed
    behind: bool = False  # answers /health but not at the synced weight version: kept out of generation
    recovering: bool = False  # the run's recover hook is bringing it to the current weights
    rejoin: bool = False  # came back (a new process, or missed a sync): the weight-update group must be rebuilt
    # gave no answer (a timeout, a refused connection) and has not answered since: the calls that only clean up after
    # a failed sync (rollback, session close, group teardown, continue) skip it instead of waiting for it again
    silent: bool = False
    paused: bool = False  # we sent it /pause_generation and it has not answered a /continue_generation since
    # its /generate requests on the wire, as (event loop, task), cut short when it is found silent; those cut
    generating: set = field(default_factory=set)
    cut: set = field(default_factory=set)
    returning_until: float = 0.0  # restarted by the run: requests wait for it until then (monotonic)
    busy: int = 0  # busy answers (429/503) to /generate in a row
    retry_after: Optional[float] = None  # the Retry-After (seconds) of its last 429/503 answer, if it sent one
    busy_warned: float = -1e9  # when its busy answers were last logged (monotonic)


def merge_routed_experts(held: Any, encoded: Optional[str], total_rows: int, start: int) -> Any:
    """Append a response's `meta_info.routed_experts` (base64 int32 [rows, layers, top_k], SGLang's format) to
    the rows held from earlier segments: rows [start, total_rows) are new. A server that ignored
    routed_experts_start_len returns all `total_rows`; the held rows are kept either way."""
    import base64

    import numpy as np
    import torch

    if total_rows <= start:
        return held  # nothing was forwarded in this segment
    if not encoded:
        raise ServerError("routed_experts were asked for but not returned: start the server with "
                          "--enable-return-routed-experts")
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    tail = total_rows - start
    width = held.shape[1] if held is not None and held.shape[0] else (flat.size // tail if tail > 0 else 0)
    rows = flat.size // width if width else 0
    if width == 0 or rows * width != flat.size or rows not in (tail, total_rows):
        raise ServerError(f"routed_experts holds {flat.size} ids: not rows of {width} for {tail} "
                          f"(or {total_rows}) tokens")
    new = torch.from_numpy(flat.reshape(rows, width)[rows - tail:].copy())
    return new if held is None else torch.cat([held, new])


def token_versions(spans: Any, n: int, fallback: int) -> list[int]:
    """One version per output token from SGLang 0.5.x `meta_info.weight_versions` spans ({version, start, end}
    over the output tokens: a retract or in-place pause puts two versions in one response); without spans
    every token gets `fallback` (the response's `weight_version`)."""
    if not isinstance(spans, list) or not spans:
        return [fallback] * n
    out = [fallback] * n
    for sp in spans:
        try:
            v, a, b = int(sp["version"]), int(sp["start"]), int(sp["end"])
        except (KeyError, TypeError, ValueError):
            return [fallback] * n
        for i in range(max(0, a), min(n, b)):
            out[i] = v
    return out


REABORT_S = 0.1  # abort_in_flight: /abort_request again this often to a server whose requests are not all back
SETTLE_QUIET_S = 2.0  # settle(): no reply for this long means what is left in flight is held by a paused server
# idle keep-alive connections are dropped after this, before the server closes them (SGLang's uvicorn: 5 s), so a
# request never goes out on a connection the server is closing
KEEPALIVE_S = 4.0


# a bucket's receivers finish its broadcast together: one still silent this long after another answered (and at
# least as long again as that one took, receive and load included) is not receiving it (hung, or never joined)
JOIN_GRACE_S = 3.0


def join_grace(first_took: float) -> float:
    """How long the other servers of a bucket get after the first one answered."""
    return max(JOIN_GRACE_S, first_took)


def _broken(e: BaseException) -> bool:
    """The connection broke before any answer (not: the server refused it, or a timeout)."""
    return isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) and \
        not isinstance(e, aiohttp.ClientConnectorError)


def _out_of_files(e: BaseException) -> bool:
    """This process ran out of file descriptors (EMFILE/ENFILE): a local shortage, not the server's fault."""
    err = getattr(e, "os_error", None) or e
    return isinstance(err, OSError) and err.errno in (errno.EMFILE, errno.ENFILE)


CONTROL_PER_SERVER = 8  # connections per server for everything but /generate (probes, pause, weight updates)
CONNECT_TIMEOUT_S = 30.0  # a TCP connect to a server (not the wait for a free connection of our own)
MAX_RESPONSE_BYTES = 1 << 30  # one answer's body: a server (or what answers at its address) cannot fill our memory


def connection_budget(servers: int = 1) -> int:
    """Connections one client session may hold for /generate at once. The open-file limit is raised to its hard
    limit first (as SGLang's launcher does); a run has two busy loops (the rollout loop's, the sync's), each with
    its generation pool and its control pool (CONTROL_PER_SERVER per server, no total limit: a weight update's
    collective calls need every server's request in flight at once), and keeps a reserve of 1,024 descriptors for
    everything else. Requests beyond it wait for a connection in the client instead of failing with 'Too many
    open files' (16,384 requests in flight did, and every server was marked down)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        soft = hard
    else:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard if hard != 1 << 20 else resource.RLIM_INFINITY))
            soft = hard
        except (ValueError, OSError):
            pass
    return max(64, (soft - 1024 - 2 * CONTROL_PER_SERVER * servers) // 2)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _lost_state(message: str) -> bool:
    """A server's refusal saying it no longer has the session or group this sync opened on it: the process was
    restarted during the sync (a new one has neither) and holds its launch weights."""
    return (END_WITHOUT_BEGIN in message or session_refusal("update_weights_from_distributed") in message
            or "no weight update group" in message)


class _SendGate:
    """One event loop's slots for /generate requests on the wire (the loop's connection budget), handed out only
    while the client is not paused. A request takes a slot before it picks a server and gives it back when its
    answer is in; one that finds no slot free, or the client paused, waits here in FIFO order, unsent and counted
    on no server. A slot freed while paused (the servers' abort answers) stays free until resume(): 65,536
    requests in flight had ~56,000 waiting for a connection inside aiohttp, and each abort answer let one of them
    out to a paused server (which held it), so the bracket waited for as many new requests as aborts."""

    def __init__(self, limit: int, unpaused: threading.Event):
        self.free = limit
        self.unpaused = unpaused
        self.waiting: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self) -> None:
        if self.free > 0 and not self.waiting and self.unpaused.is_set():
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted as it was cancelled: the slot goes on
                self.release()
            raise

    def release(self) -> None:
        self.free += 1
        self.wake()

    def wake(self) -> None:
        """Hand free slots to waiting requests (in this loop's thread; resume() schedules it)."""
        while self.free > 0 and self.waiting and self.unpaused.is_set():
            fut = self.waiting.popleft()
            if not fut.done():  # a cancelled waiter is skipped
                self.free -= 1
                fut.set_result(None)


class SGLangClient:
    def __init__(
        self,
        addresses: Sequence[str],
        *,
        api_key: Optional[str] = None,
        request_timeout: float = 300.0,
        max_retries: int = 3,
        retry_backoff: float = 0.2,
        health_check_interval: float = 1.0,
        unhealthy_timeout: float = 30.0,
        max_resubmits: int = 1000,
        version: Optional[Version] = None,
        events: Any = None,
        max_connections: Optional[int] = None,
        router: Optional[str] = None,
    ):
        if not addresses:
            raise ValueError("SGLangClient needs at least one server address (host:port)")
        self.events = events if events is not None else NullEventLog()  # interruptions on the run's timeline
        self.servers = [_Server(self._norm(a)) for a in addresses]
        # a router in front of these servers (smg: docs/inference.md, "A router in front"): generation goes through
        # it while every server serves the current weights; control and weights always go straight to the servers
        self.router: Optional[_Server] = _Server(self._norm(router)) if router else None
        self._router_bypassed: Optional[str] = None  # why generation last went around the router (logged once)
        self.router_answers = self.around_router_answers = 0  # /generate answers through it, and around it
        self._dropped_any = False  # a server was dropped for good (then generation never goes through the router)
        self._finding: dict[asyncio.AbstractEventLoop, asyncio.Future] = {}  # per loop: the find_behind under way
        self.api_key = api_key
        self.request_timeout = request_timeout
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.health_check_interval = health_check_interval
        self.unhealthy_timeout = unhealthy_timeout
        self.max_resubmits = max_resubmits
        self._version = version if version is not None else WeightVersion()  # read; owned by the weight sync
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._pause_lock = threading.Lock()
        self._resumed: dict[asyncio.AbstractEventLoop, asyncio.Future] = {}  # per loop: set by resume()
        self._sessions: dict[asyncio.AbstractEventLoop, tuple] = {}  # per event loop: (generate, control)
        self._keepers: dict[asyncio.AbstractEventLoop, Any] = {}
        self._gates: dict[asyncio.AbstractEventLoop, _SendGate] = {}  # per event loop: /generate's send slots
        self._urls: dict[tuple[str, str], URL] = {}
        self._sticky: dict[str, _Server] = {}
        self._load: list[tuple[int, int]] = []  # heap of (in_flight, server index); stale entries skipped
        self._index = {id(s): i for i, s in enumerate(self.servers)}
        self._suspects: set[int] = set()  # indices of servers this client marked unhealthy (probed until back)
        self.moved: dict[str, str] = {}  # servers started again at another address: first address -> current one
        self._in_flight = 0  # over every server
        self._choosing = 0  # requests past their send slot whose server is being chosen (not counted on one yet)
        self._served: Optional[str] = None  # the weight_version this client's last weight sync set on the servers
        self._group: Optional[list[_Server]] = None  # the servers of the current weight-update group
        self.bucket_answered: list[str] = []  # the servers that answered the bucket being sent (the sync reads it)
        # async callable(address): brings one server that came back behind to the current weights (the run's
        # weight sync sets it; None: a behind server waits for the next sync, which includes it)
        self.recover: Any = None
        self._tasks: set = set()
        # /generate requests on the wire per event loop (the rest wait in the client): the open-file budget
        budget = connection_budget(len(self.servers))
        if max_connections is not None and max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self._connections = min(budget, max_connections) if max_connections else budget
        self._emfile_warned = 0.0
        self._cut_lock = threading.Lock()  # guards every server's `generating` and `cut` (touched from two threads)
        self._rebuild_load()

    @staticmethod
    def _norm(a: str) -> str:
        return a.rstrip("/") if a.startswith("http") else f"http://{a.rstrip('/')}"

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    # ---- HTTP plumbing ---------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def aclose(self) -> None:
        """Close this event loop's HTTP sessions (a loop's sessions are also closed when asyncio.run ends it)."""
        pools = self._sessions.pop(asyncio.get_running_loop(), None)
        keeper = self._keepers.pop(asyncio.get_running_loop(), None)
        for s in pools or ():
            await s.close()
        if keeper is not None:
            await keeper.aclose()

    async def _session(self, control: bool = False) -> aiohttp.ClientSession:
        """This event loop's session for /generate, or (`control`) for every other call: its connections are
        kept alive and reused (a session may not cross loops, and the client is used from the rollout thread, the
        sync's HTTP thread and short asyncio.run loops). Two pools, so that a health probe, a pause or a weight
        update never queues behind thousands of generation requests waiting for a connection (65,536 in flight
        did: the probes timed out in the queue and every server was marked down)."""
        loop = asyncio.get_running_loop()
        pools = self._sessions.get(loop)
        if pools is None or pools[0].closed or pools[1].closed:
            for other in [x for x in list(self._sessions) if x.is_closed()]:  # ended without closing its sessions
                for s in self._sessions.pop(other):
                    s.detach()
                self._keepers.pop(other, None)
            pools = (aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self._connections,
                                                                          keepalive_timeout=KEEPALIVE_S)),
                     aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=CONTROL_PER_SERVER,
                                                                          keepalive_timeout=KEEPALIVE_S)))
            self._sessions[loop] = pools
            keeper = self._keep(loop, pools)
            await keeper.asend(None)  # started: the loop's shutdown_asyncgens() (asyncio.run does) closes them
            self._keepers[loop] = keeper
        return pools[1] if control else pools[0]

    async def _keep(self, loop: asyncio.AbstractEventLoop, pools: tuple) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if self._sessions.get(loop) is pools:
                del self._sessions[loop]
                self._keepers.pop(loop, None)
            for s in pools:
                await s.close()

    async def _request(self, method: str, server: _Server, path: str, body: Any = None,
                       timeout: Optional[float] = None, resend: bool = True) -> tuple[int, Any]:
        kw: dict[str, Any] = {"headers": self._headers()}
        if body is not None:
            kw["data"] = _dumps(body)
            kw["headers"]["Content-Type"] = "application/json"
        limit = timeout if timeout is not None else self.request_timeout
        generate = path == "/generate"
        if generate:  # the server's time to answer; waiting for one of our own connections is not the server's
            kw["timeout"] = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=CONNECT_TIMEOUT_S,
                                                  sock_read=limit)
        else:
            kw["timeout"] = aiohttp.ClientTimeout(total=limit)
        session = await self._session(control=not generate)
        url = self._urls.get((server.address, path))
        if url is None:  # parsed once per server and path (yarl's parse costs ~10 us a call)
            url = self._urls[(server.address, path)] = URL(server.address + path)
        try:
            try:
                return await self._send(session, method, url, kw, server=server)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                # the connection broke before any answer: most often a kept-alive one the server closed while idle
                # (its keep-alive ran out while this loop was busy), which the request never reached; so it goes
                # once more, as aiohttp does for idempotent methods. A dead server refuses the new connection.
                if not resend or not _broken(e):
                    raise
                return await self._send(session, method, url, kw, server=server)
        except asyncio.TimeoutError as e:  # aiohttp's says nothing of whom it waited for (often an empty message)
            if isinstance(e, ServerTimeout):
                raise
            raise ServerTimeout(server.address, path, limit) from e

    @staticmethod
    async def _send(session: aiohttp.ClientSession, method: str, url: URL, kw: dict, cap: int = MAX_RESPONSE_BYTES,
                    server: Optional[_Server] = None) -> tuple[int, Any]:
        async with session.request(method, url, **kw) as r:
            if server is not None and r.status in BUSY:
                server.retry_after = _retry_after(r.headers.get("Retry-After"))
            if r.content_length is not None and r.content_length > cap:
                raise ServerError(f"{url} answered {r.status} with a {r.content_length}-byte body, more than the "
                                  f"{cap}-byte bound on one answer")
            body = bytearray()
            async for chunk in r.content.iter_any():  # a body without Content-Length is bounded as it arrives
                body += chunk
                if len(body) > cap:
                    raise ServerError(f"{url} answered {r.status} with a body past the {cap}-byte bound on one "
                                      "answer; stopped reading it")
            enc = r.charset or "utf-8"  # as r.json() and r.text() would decode it (JSON is UTF-8)
            try:
                codecs.lookup(enc)
            except LookupError:  # a charset no codec knows: read it as UTF-8, as the protocol is
                enc = "utf-8"
            if r.content_type == "application/json":
                return r.status, _loads(body.decode(enc)) if body.strip() else None
            return r.status, body.decode(enc, errors="replace")

    # ---- server choice and health ----------------------------------------------------------
    def _rebuild_load(self) -> None:
        self._index = {id(s): i for i, s in enumerate(self.servers)}
        self._load = [(s.in_flight, i) for i, s in enumerate(self.servers) if s.healthy]
        heapq.heapify(self._load)

    def _count(self, s: _Server, delta: int) -> None:
        """A request starts (+1) or ends (-1) on s: the least-loaded heap gets s's new load."""
        s.in_flight += delta
        self._in_flight += delta
        self._push(s)
        if len(self._load) > 4 * len(self.servers) + 64:  # drop the stale entries now and then: O(1) amortized
            self._rebuild_load()

    def _push(self, s: _Server) -> None:
        i = self._index.get(id(s))
        if i is not None:
            heapq.heappush(self._load, (s.in_flight, i))

    def _least_loaded(self) -> Optional[_Server]:
        """The healthy server with the fewest requests in flight (the first one on a tie), in O(log N)."""
        h, servers = self._load, self.servers
        while h:
            n, i = h[0]
            s = servers[i] if i < len(servers) else None
            if s is not None and s.healthy and s.in_flight == n:
                return s
            heapq.heappop(h)
        if len(self._index) != len(self.servers) or any(s.healthy for s in self.servers):
            self._rebuild_load()  # servers changed, or one was re-admitted from outside: look again, once
            return min((s for s in self.servers if s.healthy), key=lambda x: x.in_flight, default=None)
        return None

    async def _probe(self, s: _Server) -> bool:
        s.last_probe = time.monotonic()
        try:
            status, _ = await self._request("GET", s, "/health", timeout=2.0)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            status = None
        if status != 200:
            s.behind = False  # a behind server that went down again is down: no sync target until it answers
            return False
        s.silent = False
        if not s.healthy and s.dropped is None:
            await self._readmit(s)
        return s.healthy

    async def _readmit(self, s: _Server) -> None:
        """A server answering /health again generates only with the weights the last sync set: a restarted
        process has its launch weights and one that was down during a sync missed it. Behind, it is kept out
        (it still gets every weight sync) and the `recover` hook, if set, brings it up to date; a later probe
        admits it. Before this client's first sync every server has its launch weights: admitted on any answer.
        One whose /health answers while its other calls fail (5xx) stays out and is probed again later. One that a
        sync paused and lost (it hung, or went down, in the bracket) is continued first: the sync's own
        /continue_generation skipped it, and a stopped process that resumes runs the /pause_generation it had."""
        if s.paused and self._unpaused.is_set():  # (while paused, the bracket's own continue comes)
            try:
                status, _ = await self._request("POST", s, "/continue_generation", {}, timeout=5.0)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                return
            if status != 200:
                return
            s.paused = False
        try:
            status, info = await self._request("GET", s, "/model_info", timeout=5.0)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return
        if status >= 500:
            return
        if self._served is not None:
            have = info.get("weight_version") if status == 200 and isinstance(info, dict) else None
            if str(have) != self._served:
                self._set_behind(s, have)
                return
        if s.healthy or s.dropped is not None:  # another probe of it got here first
            return
        if not s.behind:  # back after a failure, maybe as a new process (no weight-update group, no session)
            s.rejoin, s.session_open = True, False
        logger.info("server %s is healthy again%s; re-admitted", s.address,
                    " at the current weight version" if s.behind else "")
        s.healthy, s.failures, s.behind, s.returning_until = True, 0, False, 0.0
        self._suspects.discard(self._index.get(id(s), -1))
        self._push(s)

    def _set_behind(self, s: _Server, have: Any) -> None:
        """s serves another weight version than the last sync set: out of generation until it has the current
        ones (the recover hook, or the next sync, which builds the weight-update group again with it)."""
        if not s.behind:
            logger.warning("server %s is at weight version %s, the run's is %s: kept out until it has the current "
                           "weights", s.address, have, self._served)
            self.events.emit("server_behind", server=s.address, version=str(have))
            s.rejoin = True
        s.behind, s.healthy, s.session_open = True, False, False  # a new process has no session; a hung one's is
        if s.dropped is None:                                   # closed by the next begin (SGLang refuses two)
            self._suspects.add(self._index.get(id(s), -1))
        self._start_recovery(s)

    async def find_behind(self, timeout: float = 10.0) -> list[str]:
        """Ask every serving server for its weight version (GET /model_info): one that restarted between two
        of our requests has its launch version and no weight-update group. Marks those (and any that does not
        answer) out of generation; returns their addresses."""
        if self._served is None:
            return []
        found: list[str] = []

        async def one(s: _Server) -> None:
            try:
                status, info = await self._request("GET", s, "/model_info", timeout=timeout)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self._mark_unhealthy(s, f"/model_info: {_why(e)}", silent=True)
                found.append(s.address)
                return
            have = info.get("weight_version") if status == 200 and isinstance(info, dict) else None
            if str(have) != self._served:
                self._set_behind(s, have)
                found.append(s.address)

        await asyncio.gather(*(one(s) for s in self.servers if s.dropped is None and s.healthy))
        return found

    async def _find_behind_once(self) -> None:
        """find_behind, one at a time per event loop: the requests that got a stale answer together wait for the
        same look (not one each)."""
        loop = asyncio.get_running_loop()
        fut = self._finding.get(loop)
        if fut is None or fut.done():
            for other in [x for x in self._finding if x.is_closed()]:
                del self._finding[other]
            fut = self._finding[loop] = loop.create_task(self.find_behind())
        await asyncio.shield(fut)

    def _stale_answer(self, meta: dict, sent_at: int) -> Optional[str]:
        """The weight version of an answer that no up-to-date server could have given: every token generated
        after a request was sent at version v comes from v or later (the version moves only after every server
        committed it). A server that did is behind (restarted between two requests, at its launch weights)."""
        if self._served is None:
            return None
        spans = meta.get("weight_versions")
        said = [sp.get("version") for sp in spans if isinstance(sp, dict)] if isinstance(spans, list) and spans \
            else [meta.get("weight_version")]
        for v in said:
            try:
                if int(v) >= sent_at:
                    continue
            except (TypeError, ValueError):
                pass
            return str(v)
        return None

    def _start_recovery(self, s: _Server) -> None:
        if self.recover is None or s.recovering:
            return
        s.recovering = True

        async def run() -> None:
            try:
                await self.recover(s.address)
            except Exception as e:  # noqa: BLE001 - tried again when the server is probed next
                logger.warning("bringing server %s to the current weights failed: %s: %s", s.address,
                               type(e).__name__, e)
            finally:
                s.recovering = False
                s.last_probe = 0.0  # probed again on the next request

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def probe_down(self) -> None:
        """Probe every server that is out of generation (not dropped) once: one that answers again is admitted,
        or found behind (then the coming weight sync includes it)."""
        await asyncio.gather(*(self._probe(s) for s in self.servers if not s.healthy and s.dropped is None))

    def sync_targets(self) -> list[_Server]:
        """The servers a weight sync sends to: not dropped, and either serving or back but behind (a server
        that is down or hung is left out; when it answers again it is behind and joins the next sync)."""
        return [s for s in self.servers if s.dropped is None and (s.healthy or s.behind)]

    def expect_back(self, address: str, seconds: float) -> None:
        """The run restarted this server: with no other server usable, requests wait up to `seconds` for it (not
        just `unhealthy_timeout`), as long as it can be brought to the current weights without a sync (the
        `recover` hook) or is not behind."""
        for s in self._named([address]):
            s.returning_until = time.monotonic() + seconds

    def readdress(self, old: str, new: str) -> None:
        """The run started this server again at another address (its port was taken while it was down): the same
        server, reached at `new` from now on; out of generation until it serves the current weights, as after any
        restart."""
        new = self._norm(new)
        if any(s.address == new for s in self.servers):
            raise ValueError(f"{new} is already one of this client's servers")
        for s in self._named([old]):
            logger.warning("server %s is now at %s (started again at another port)", s.address, new)
            self.moved = {k: (new if v == s.address else v) for k, v in self.moved.items()}
            self.moved.setdefault(s.address, new)
            s.address = new
            s.last_probe = 0.0

    def adopt(self, addresses: Sequence[str], moved: Optional[dict[str, str]] = None) -> None:
        """Servers named elsewhere (rank 0 names a pipeline stage head's group members) that this client does not
        know yet: added, for control calls. `moved` (rank 0's `moved`) first takes a server this client knows at
        an address it has left to its new one, so the moved server is not kept twice."""
        for old, new in (moved or {}).items():
            at = {s.address for s in self.servers}
            if self._norm(old) in at and self._norm(new) not in at:
                self.readdress(old, new)
        known = {s.address for s in self.servers}
        new = list(dict.fromkeys(a for a in map(self._norm, addresses) if a not in known))
        if new:
            self.servers.extend(_Server(a) for a in new)
            self._rebuild_load()

    def drop(self, address: str, why: str) -> None:
        """Give up on a server for good (e.g. the run restarted it too often)."""
        for s in self.servers:
            if s.address == self._norm(address):
                self._drop(s, why)

    def _drop(self, s: _Server, why: str) -> None:
        if s.dropped is None:  # the first reason is kept (requests in flight may fail it once more)
            logger.error("server %s dropped: %s", s.address, why)
            s.dropped = why
            self._dropped_any = True
        s.healthy = False
        self._suspects.discard(self._index.get(id(s), -1))

    def _no_server_error(self, waited: Optional[float]) -> NoHealthyServerError:
        def state(s: _Server) -> str:
            if s.dropped:
                return f"dropped: {s.dropped}"
            if s.behind:
                return "behind the synced weight version"
            if s.healthy:
                return "serving"
            return f"down ({s.down})" if s.down else "unreachable"

        why = "; ".join(f"{s.address}: {state(s)}" for s in self.servers[:8])
        if len(self.servers) > 8:
            why += f"; and {len(self.servers) - 8} more"
        after = f" for {waited:.0f}s" if waited is not None else ""
        return NoHealthyServerError(f"no usable inference server{after} ({why}); check the servers' logs")

    def mark_silent(self, address: str, why: str) -> None:
        """The sync found this server not taking part (e.g. it acknowledged a bucket it never received): out of
        generation and of the next sync, as if it gave no answer, until it answers again (then re-admitted behind,
        at the current version)."""
        for s in self._named([address]):
            self._mark_unhealthy(s, why, silent=True)

    def _mark_unhealthy(self, s: _Server, why: str, silent: bool = False) -> None:
        """s is out of generation (and of the next sync) until it answers again; `silent`: it gave no answer at
        all (timeout, connection refused or broken), so clean-up calls skip it (see `answering`)."""
        if s.healthy or s.behind:
            logger.warning("server %s marked unhealthy: %s", s.address, why)
        s.healthy = False
        s.down = why
        s.silent = s.silent or silent
        if silent:
            self._cut_generation(s)
            if self.router is not None:  # some of the router's requests may be on s: sent again with their tokens
                self._cut_generation(self.router)
        s.behind = False  # failing, not just behind: no sync target until it answers again (then behind, if so)
        s.last_probe = time.monotonic()
        if s.dropped is None:
            self._suspects.add(self._index.get(id(s), -1))

    def _cut_generation(self, s: _Server) -> None:
        """s gave no answer: its /generate requests on the wire (from any thread's loop) end now with ServerHung
        and go to another server with their tokens so far, as from a dead server (whose connections reset)."""
        with self._cut_lock:
            entries = list(s.generating)
            s.cut.update(task for _, task in entries)
        for loop, task in entries:
            with contextlib.suppress(RuntimeError):  # that loop has ended
                loop.call_soon_threadsafe(task.cancel)

    async def _cuttable(self, s: _Server, coro: Any) -> tuple[int, Any]:
        """Await a /generate on s as a task `_cut_generation` may cut short (then ServerHung)."""
        loop = asyncio.get_running_loop()
        task = loop.create_task(coro)
        entry = (loop, task)
        with self._cut_lock:
            s.generating.add(entry)
        try:
            return await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task in s.cut and not (me is not None and me.cancelling()):  # cut, not cancelled from outside
                raise ServerHung(f"{s.address}/generate cut short: the server gave no answer ({s.down})") from None
            raise
        finally:
            with self._cut_lock:
                s.generating.discard(entry)
                s.cut.discard(task)

    async def _choose(self, rid: Optional[str]) -> _Server:
        """The request's sticky server, else the least loaded healthy one. Servers this client marked unhealthy
        are probed (at most once per health_check_interval each) on the way; with none healthy it waits up
        to `unhealthy_timeout`, probing every server that is not dropped. O(log N) while all is well."""
        deadline = time.monotonic() + self.unhealthy_timeout
        while True:
            now = time.monotonic()
            if self._suspects:
                stale = [self.servers[i] for i in list(self._suspects) if 0 <= i < len(self.servers)
                         and now - self.servers[i].last_probe >= self.health_check_interval]
                if stale:
                    await asyncio.gather(*(self._probe(s) for s in stale))
            s = self._sticky.get(rid) if rid else None
            if s is not None and s.healthy:
                return s
            s = self._least_loaded()
            if s is not None:
                if rid:
                    self._sticky[rid] = s
                return s
            if all(s.dropped for s in self.servers):
                raise self._no_server_error(None)
            stale = [s for s in self.servers  # none usable: probe every server that is not dropped
                     if not s.healthy and not s.dropped and now - s.last_probe >= self.health_check_interval]
            if stale:
                await asyncio.gather(*(self._probe(s) for s in stale))
                if any(s.healthy for s in stale):
                    continue
            if time.monotonic() >= deadline:
                back = [x.returning_until for x in self.servers if x.dropped is None and x.returning_until > now
                        and (self.recover is not None or not x.behind)]
                if not back:
                    raise self._no_server_error(self.unhealthy_timeout)
                deadline = max(back)  # a restarted server is on its way
            await asyncio.sleep(min(self.health_check_interval, max(0.0, deadline - time.monotonic())))

    async def _via_router(self) -> Optional[_Server]:
        """The router, when generation may go through it: it answers, and every server is serving the current
        weights. While one is out (down, behind the synced version, restarting, dropped) the router would still
        send it requests, so generation goes straight to the serving servers, chosen here, until all serve again."""
        r = self.router
        if r is None:
            return None
        if not r.healthy:
            if time.monotonic() - r.last_probe < self.health_check_interval:
                return None
            r.last_probe = time.monotonic()
            try:
                status, _ = await self._request("GET", r, "/health", timeout=2.0)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                return None
            if status != 200:
                return None
            logger.info("router %s answers again; generation goes through it", r.address)
            r.healthy, r.down, r.busy = True, "", 0
        out = next((s for s in self.servers if not s.healthy), None) if self._suspects or self._dropped_any else None
        if out is not None:
            why = f"server {out.address} is out ({'dropped: ' + out.dropped if out.dropped else out.down or 'behind'})"
            if self._router_bypassed is None:
                logger.warning("generation goes straight to the serving servers, not through router %s: %s",
                               r.address, why)
            self._router_bypassed = why
            return None
        if self._router_bypassed is not None:
            logger.info("every server serves again: generation goes through router %s", r.address)
            self._router_bypassed = None
        return r

    def router_stats(self) -> Optional[dict[str, int]]:
        """With a router: the /generate answers so far that came through it and that went around it (a server out,
        or the router failing); None without one."""
        if self.router is None:
            return None
        return {"answers": self.router_answers, "around": self.around_router_answers}

    def _router_down(self, why: str) -> None:
        r = self.router
        if r is not None and r.healthy:
            logger.warning("router %s failed (%s): generation goes straight to the servers until it answers /health",
                           r.address, why)
        if r is not None:
            r.healthy, r.down, r.last_probe = False, why, time.monotonic()

    def _gate(self) -> _SendGate:
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            for other in [x for x in self._gates if x.is_closed()]:
                del self._gates[other]
            gate = self._gates[loop] = _SendGate(self._connections, self._unpaused)
        return gate

    async def _generate_once(self, rid: str, payload: dict) -> tuple[dict, _Server]:
        """POST /generate with retries; reroutes to another server when one dies. A retry gets its own request
        id: the server may still hold the first attempt under the old one. The request holds one of the loop's
        send slots while it is on the wire, and waits for one unsent (never while the client is paused)."""
        attempt = 0
        first_rid = payload["rid"]
        resent = False
        busy_since: Optional[float] = None  # the first of the busy answers this request is getting in a row
        gate = self._gate()
        while True:
            error: Optional[BaseException] = None
            # acquire/release, not an async-generator context manager: asyncio.run's shutdown_asyncgens may close
            # that generator under a task still inside it, and its exit then raised "generator didn't stop after
            # athrow()" in place of the task's own error (e.g. the one naming the dead server)
            await gate.acquire()
            try:
                self._choosing += 1  # on its way to a server not chosen yet (abort_in_flight waits for it too)
                try:
                    s = await self._via_router() or await self._choose(rid)
                finally:
                    self._choosing -= 1
                self._count(s, 1)
                try:
                    payload["rid"] = first_rid if attempt == 0 else f"{first_rid}-r{attempt}"
                    status, body = await self._cuttable(s, self._request("POST", s, "/generate", payload,
                                                                         resend=False))
                except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
                    error = e
                finally:
                    self._count(s, -1)
            finally:
                gate.release()
            if (e := error) is not None:  # handled without the slot (the retry waits)
                attempt += 1
                if _out_of_files(e):  # ours, not the server's: wait for descriptors to free up
                    if time.monotonic() - self._emfile_warned > 10.0:
                        self._emfile_warned = time.monotonic()
                        logger.warning("out of file descriptors (%s); requests wait and retry", e)
                    await asyncio.sleep(self.retry_backoff * min(attempt, 10))
                    continue
                if _broken(e) and not resent:  # most often a kept-alive connection the server had closed: the
                    resent = True  # same server again at once (a dead one refuses the new connection)
                    continue
                if isinstance(e, ServerHung):  # cut short: its server was marked already, with the reason
                    pass
                elif s is self.router:
                    self._router_down(_why(e))
                else:
                    self._mark_unhealthy(s, _why(e), silent=True)
                self._sticky.pop(rid, None)
                await asyncio.sleep(self.retry_backoff * min(attempt, 10))
                continue
            if status in BUSY:  # backpressure, not a failure: wait, then the least loaded server again
                now = time.monotonic()
                busy_since = now if busy_since is None else busy_since
                attempt += 1
                s.busy += 1
                # a server down as a whole (restarting, the fleet's `error`) is out until /model_info answers; the
                # router is only ever waited for
                if s.busy > self.max_retries and s is not self.router and await self._failing_throughout(s):
                    self._mark_unhealthy(s, f"/generate answered {status} {s.busy} times in a row and /model_info "
                                            "fails too")
                    s.busy = 0
                    self._sticky.pop(rid, None)
                    continue  # reroute at once
                if now - busy_since > self.request_timeout:
                    raise ServerError(f"{s.address}/generate answered {status} (busy: {_error_message(body)[:200]}) "
                                      f"for {now - busy_since:.0f} s: raise the server's queue bound "
                                      "(--max-queued-requests) or lower the rollout's concurrency")
                delay = s.retry_after if s.retry_after is not None else self.retry_backoff * 2 ** min(attempt, 5)
                delay = min(max(delay, self.retry_backoff), BUSY_WAIT_MAX_S)
                if now - s.busy_warned > 10.0:
                    s.busy_warned = now
                    logger.warning("server %s is busy (%s: %s); requests wait %.1f s and retry (not counted as "
                                   "failures)", s.address, status, _error_message(body)[:120], delay)
                self._sticky.pop(rid, None)
                await asyncio.sleep(delay)
                continue
            busy_since = None
            if status >= 500:
                s.failures += 1
                attempt += 1
                if s.failures > self.max_retries:
                    why = f"/generate answered {status} {s.failures} times in a row: {_error_message(body)[:200]}"
                    if s is self.router:  # around it to the servers until it answers /health again; never dropped
                        self._router_down(why)
                        s.failures = 0
                    elif await self._failing_throughout(s):  # out until its /model_info answers again
                        self._mark_unhealthy(s, why + " (and /model_info fails too)")
                        s.failures = 0
                    else:  # a wedged engine behind a working front (/health may answer): never re-admitted
                        self._drop(s, why)
                    self._sticky.pop(rid, None)
                    continue  # reroute at once
                await asyncio.sleep(self.retry_backoff * 2 ** min(s.failures, 6))
                continue
            if status != 200:
                raise classify_status(s.address, "/generate", status, body)
            s.failures = s.busy = 0
            if self.router is not None:
                if s is self.router:
                    self.router_answers += 1
                else:
                    self.around_router_answers += 1
            return body, s

    async def _failing_throughout(self, s: _Server) -> bool:
        """Whether a server whose /generate keeps answering 5xx fails its other calls too (unreachable, or /model_info
        answers 5xx): a server failing as a whole (overloaded, restarting, the fleet's `error` failure) is taken out
        and re-admitted once /model_info answers; one whose other calls answer has a wedged engine and is dropped."""
        try:
            status, _ = await self._request("GET", s, "/model_info", timeout=5.0)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return True
        return status >= 500

    # ---- generation ------------------------------------------------------------------------
    async def _wait_unpaused(self) -> None:
        """Until resume(): every request of a loop waits on one future that resume() sets (no polling)."""
        while not self._unpaused.is_set():
            loop = asyncio.get_running_loop()
            with self._pause_lock:
                if self._unpaused.is_set():
                    return
                fut = self._resumed.get(loop)
                if fut is None or fut.done():
                    fut = self._resumed[loop] = loop.create_future()
            await asyncio.shield(fut)  # a cancelled waiter leaves the shared future to the others

    async def agenerate(self, req: ModelRequest, resume: Optional[ModelResponse] = None) -> ModelResponse:
        """Generate until stop or `max_new_tokens`, across interruptions. `resume`: a partial response of this
        request (e.g. from a checkpoint) to continue; it is extended in place, so its owner sees every token
        as it arrives."""
        t0 = time.monotonic()
        resp = resume if resume is not None else ModelResponse(input_tokens=list(req.input_ids))
        rounds = dropped_answers = 0
        try:
            while len(resp.output_tokens) < req.max_new_tokens:
                await self._wait_unpaused()
                if rounds:
                    self.events.emit("episode_resubmitted", rid=req.rid, tokens=len(resp.output_tokens))
                payload = {
                    "input_ids": list(req.input_ids) + resp.output_tokens,
                    "sampling_params": {
                        "max_new_tokens": req.max_new_tokens - len(resp.output_tokens),
                        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                        "stop_token_ids": list(req.stop_token_ids), "ignore_eos": req.ignore_eos,
                        "skip_special_tokens": False,
                    },
                    "return_logprob": True,
                    "rid": f"{req.rid}-{rounds}",
                }
                held = 0 if resp.routed_experts is None else int(resp.routed_experts.shape[0])
                if req.return_routed_experts:  # rows already held keep the routes of the weights that made them
                    payload.update(return_routed_experts=True, routed_experts_start_len=held)
                sent_at = self._version.value
                out, server = await self._generate_once(req.rid, payload)
                meta = out["meta_info"]
                if (stale := self._stale_answer(meta, sent_at)) is not None:  # its tokens are dropped, sent again
                    if server is self.router:  # which server answered is not known: ask each for its version
                        await self._find_behind_once()
                    else:
                        self._set_behind(server, stale)
                    self._sticky.pop(req.rid, None)
                    dropped_answers += 1
                    if dropped_answers > self.max_retries:
                        raise ServerError(f"request {req.rid}: {dropped_answers} answers at weight version {stale}, "
                                          f"older than the synced {self._served}")
                    continue
                version = self._parse_version(meta.get("weight_version"))
                lps = meta.get("output_token_logprobs") or []
                toks = list(out.get("output_ids") or [])
                if len(lps) != len(toks):
                    raise ServerError(f"{len(toks)} output tokens but {len(lps)} logprobs in the response")
                resp.output_tokens += toks
                resp.output_logprobs += [float("-inf") if x[0] is None else float(x[0]) for x in lps]
                resp.output_versions += token_versions(meta.get("weight_versions"), len(toks), version)
                if req.return_routed_experts:
                    resp.routed_experts = merge_routed_experts(resp.routed_experts, meta.get("routed_experts"),
                                                               len(payload["input_ids"]) + len(toks) - 1, held)
                fr = meta.get("finish_reason") or {}
                kind = fr.get("type") if isinstance(fr, dict) else str(fr)
                if kind in ("stop", "length"):
                    resp.stop_reason = kind
                    break
                if kind != "abort":
                    raise ServerError(f"unexpected finish_reason {fr!r}")
                rounds += 1
                resp.num_interruptions += 1
                self.events.emit("episode_interrupted", rid=req.rid, tokens=len(resp.output_tokens))
                if rounds > self.max_resubmits:
                    raise ServerError(f"request {req.rid} aborted {rounds} times: {fr.get('message')}")
            else:
                resp.stop_reason = "length"
        finally:
            self._sticky.pop(req.rid, None)
        resp.latency = time.monotonic() - t0
        return resp

    def _parse_version(self, v: Any) -> int:
        try:
            return int(v)
        except (TypeError, ValueError):
            return self.version

    # ---- client-side pause and version -----------------------------------------------------
    def pause(self) -> None:
        """Interrupted requests wait here before resubmitting (until resume)."""
        self._unpaused.clear()

    def resume(self) -> None:
        with self._pause_lock:
            self._unpaused.set()
            waiting, self._resumed = self._resumed, {}
        for loop, fut in waiting.items():
            with contextlib.suppress(RuntimeError):  # that loop has ended meanwhile
                loop.call_soon_threadsafe(_wake, fut)
        for loop, gate in list(self._gates.items()):  # requests held unsent go out
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(gate.wake)

    def settle(self, timeout: float, quiet: float = SETTLE_QUIET_S) -> int:
        """After the servers paused (abort mode): block until every aborted request's partial output has come
        back, so a snapshot holds it. SGLang's pause returns once the aborted requests are done; what is still
        in flight after `quiet` seconds without a reply was sent as the pause began and waits, with no new
        tokens, in the paused server's queue until it continues: it is not waited for. Thread-safe (reads
        counters only). Returns how many requests are still in flight."""
        deadline, last = time.monotonic() + timeout, None
        while True:
            n = self._in_flight
            now = time.monotonic()
            if n != last:
                last, changed = n, now
            if n == 0 or now - changed >= quiet or now >= deadline:
                return n
            time.sleep(0.005)

    @property
    def version(self) -> int:
        return self._version.value

    # ---- control, to all servers concurrently -----------------------------------------------
    async def _post_all(self, path: str, body: dict, *, check: bool = True, only_healthy: bool = False,
                        bodies: Optional[list[dict]] = None, timeout: Optional[float] = None,
                        servers: Optional[list[_Server]] = None) -> list[Any]:
        targets = servers if servers is not None else [s for s in self.servers if s.healthy or not only_healthy]

        async def one(i: int, s: _Server) -> Any:
            try:
                status, out = await self._request("POST", s, path, bodies[i] if bodies else body, timeout=timeout)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self._mark_unhealthy(s, f"{path}: {_why(e)}", silent=True)
                if check:
                    raise ServerError(_failed(s, path, e)) from e
                return None
            if status >= 500:  # failing inside: out of generation and of the next sync until it answers again
                self._mark_unhealthy(s, f"{path} answered {status}: {_error_message(out)[:200]}")
            ok = status == 200 and not (isinstance(out, dict) and out.get("success") is False)
            if not ok and status == 400 and _lost_state(_error_message(out)):  # restarted since the sync began?
                await self._restarted(s, timeout)  # then behind, and the sync is done again (it needs a new group)
            if not ok and check:
                msg = out.get("message") if isinstance(out, dict) else out
                raise ServerError(f"{s.address}{path} answered {status}: {msg}")
            return out

        return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(targets))))

    async def pause_generation(self, mode: str = "abort", timeout: Optional[float] = None) -> None:
        """SGLang's modes: abort (in-flight requests return their partial output; we resubmit them), retract
        (they go back to the server's queue and are prefilled again under the new weights) or in_place (they
        keep their place and their KV cache). A server is marked paused before the call (one that times out may
        still pause) until a /continue_generation answers."""
        targets = [s for s in self.servers if s.healthy]
        for s in targets:
            s.paused = True
        await self._post_all("/pause_generation", {"mode": mode}, timeout=timeout, servers=targets)

    async def abort_in_flight(self, timeout: float) -> int:
        """Before an abort pause: SGLang's /abort_request (abort_all) to every server a pause goes to, then wait,
        at most `timeout` seconds, for this client's requests on the servers that answered to come back with
        their partial output (the loop that sent them must be running to read them; `pause()` holds their
        resubmission). SGLang's abort-mode /pause_generation aborts too, but while any request handler still
        holds its lock it then sleeps 1.0 s before looking again (tokenizer_manager.pause_generation, 0.5.23):
        aborted first, nothing holds it and the pause answers at once. A request still on its way when the abort
        came runs: the abort is sent again every REABORT_S to a server that has not answered all of this
        client's requests (one outstanding at a time), and a request whose server is still being chosen is waited
        for too. Only servers whose pause waits so (`Release.pause_polls`: SGLang; a release not known yet is
        asked once, without marking a server that does not answer in time down); the embedded server's pause
        needs no help, and its aborted answers are read after the pause, with the rollout
        loop parked meanwhile. The requests of a server that fails /abort_request are not waited for, and one that
        gives it no answer holds the wait to its limit at most: the pause that follows aborts on them and reports
        such a server. Returns how many requests are still in flight."""
        deadline = time.monotonic() + timeout
        # a release not known yet (a disk sync's servers before their first update), each asked on its own: one that
        # cannot say (a router given as a server, no answer in time) stays unknown and is left to the pause
        await asyncio.gather(*(self._learn([s], timeout, down_ok=True, mark=False) for s in self.servers
                               if s.healthy and s.release is None), return_exceptions=True)
        targets = [s for s in self.servers if s.healthy and s.release is not None and s.release.pause_polls]

        async def abort(s: _Server) -> bool:
            try:
                status, _ = await self._request("POST", s, "/abort_request", {"abort_all": True},
                                                timeout=max(0.01, deadline - time.monotonic()))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                return False
            return status == 200

        first = [(s, asyncio.ensure_future(abort(s))) for s in targets]  # each server's answer counts as it comes
        later: list[tuple[_Server, asyncio.Future]] = []  # aborts sent again: at most one outstanding per server
        answered: list[_Server] = []
        again = time.monotonic() + REABORT_S
        try:
            while time.monotonic() < deadline:
                answered += [s for s, t in first if t.done() and t.result()]
                first = [(s, t) for s, t in first if not t.done()]
                answered = [s for s in answered if s.healthy]  # one marked down meanwhile: its requests are cut
                routed = self.router is not None and answered and self.router.in_flight  # on any of them
                left = answered if routed else [s for s in answered if s.in_flight]
                if not left and not first and not (answered and self._choosing):
                    break
                later = [(s, t) for s, t in later if not t.done()]
                if left and time.monotonic() >= again:  # a request on its way when the abort came runs now
                    busy = {id(s) for s, _ in later}
                    later += [(s, asyncio.ensure_future(abort(s))) for s in left if id(s) not in busy]
                    again = time.monotonic() + REABORT_S
                await asyncio.sleep(0.005)
        finally:
            pending = [t for _, t in first] + [t for _, t in later]
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return self._in_flight

    async def wait_idle(self, timeout: float) -> None:
        """Until no request of this client is in flight (rollout.interrupt=none: generation finishes before the
        servers pause; new requests are held by `pause()` meanwhile). Raises ServerError after `timeout`."""
        deadline = time.monotonic() + timeout
        while (n := self._in_flight):
            if time.monotonic() > deadline:
                raise ServerError(f"{n} requests still in flight after {timeout:g}s (rollout.interrupt=none "
                                  "waits for them before pausing; raise trainer.sync_timeout)")
            await asyncio.sleep(0.01)

    async def continue_generation(self, timeout: Optional[float] = None) -> None:
        """Never raises for a dead server: the others must not be left paused. A server that gave no answer since
        it was last heard from is skipped (waiting for it again would only delay the others); it is continued
        when it answers again, before it is re-admitted (`_readmit`)."""
        targets = self.answering(self.servers)
        replies = await self._post_all("/continue_generation", {}, check=False, timeout=timeout, servers=targets)
        for s, r in zip(targets, replies):
            if r is not None and not s.silent:
                s.paused = False

    def answering(self, servers: Sequence[_Server]) -> list[_Server]:
        """`servers` without those that gave no answer (timeout, refused connection) since they last answered."""
        return [s for s in servers if not s.silent]

    @property
    def silent(self) -> list[str]:
        """Servers that gave no answer (timeout, refused connection) since they last answered."""
        return [s.address for s in self.servers if s.silent]

    def _named(self, addresses: Sequence[str]) -> list[_Server]:
        by = {s.address: s for s in self.servers}
        try:
            return [by[self._norm(a)] for a in addresses]
        except KeyError as e:
            raise ValueError(f"{e.args[0]} is not one of this client's servers") from None

    async def update_weights_from_disk(self, path: str, version: int | str, check: bool = True,
                                       flush_cache: bool = True, addresses: Optional[Sequence[str]] = None,
                                       timeout: Optional[float] = None) -> list[Any]:
        """The sync's servers (`sync_targets`), or those at `addresses`, load the HF directory `path`.
        `check=False`: never raises; failed servers' replies are returned as they came (None for an unreachable
        one), in the order of the servers. `flush_cache=False` with in-place pauses: SGLang 0.5.21+ fails an
        update whose flush finds requests still running."""
        targets = self._named(addresses) if addresses is not None else self.sync_targets()
        return await self._post_all("/update_weights_from_disk", {"model_path": str(path), "weight_version":
                                                                  str(version), "flush_cache": flush_cache},
                                    check=check, servers=targets, timeout=timeout)

    def synced(self, version: int | str) -> None:
        """A weight sync to `version` succeeded on every server it targeted (the sync calls this after its
        commit and session close): from now on a server is admitted only at this version."""
        self._served = str(version)

    async def init_weights_update_group(self, master_address: str, master_port: int, group_name: str,
                                        backend: str = "gloo", gpus_per_server: int = 1,
                                        timeout: Optional[float] = None,
                                        addresses: Optional[Sequence[str]] = None) -> int:
        """The group's servers (`addresses`, default `sync_targets`) join at rank_offset = 1 + GPUs before each;
        returns the world size (trainer is rank 0). Later distributed updates go to exactly these servers."""
        members = self._named(addresses) if addresses is not None else self.sync_targets()
        if not members:
            raise self._no_server_error(None)
        self._group = members
        for s in members:
            s.rejoin = False
        world = 1 + gpus_per_server * len(members)
        bodies = [{"master_address": master_address, "master_port": master_port, "rank_offset": 1 + i * gpus_per_server,
                   "world_size": world, "group_name": group_name, "backend": backend} for i in range(len(members))]
        await self._post_all("/init_weights_update_group", {}, bodies=bodies, timeout=timeout, servers=members)
        return world

    @property
    def group_members(self) -> list[str]:
        """The servers of the current weight-update group (none built: [])."""
        return [s.address for s in self._group or []]

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, version: int | str | None = None,
                                              load_format: Optional[str] = None, timeout: Optional[float] = None,
                                              flush_cache: bool = True) -> None:
        """One bucket: every server receives the broadcast that the trainer starts after posting this.
        `load_format="flattened_bucket"`: the bucket travels as one uint8 buffer (SGLang's layout)."""
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                "flush_cache": flush_cache}
        if version is not None:
            body["weight_version"] = str(version)
        if load_format is not None:
            body["load_format"] = load_format
        servers = self._group if self._group is not None else self.sync_targets()
        self.bucket_answered = []
        if not names or len(servers) < 2:
            await self._post_all("/update_weights_from_distributed", body, timeout=timeout, servers=servers)
            self.bucket_answered = [s.address for s in servers]
            return
        await self._bucket_to_all(body, servers, timeout)

    async def _bucket_to_all(self, body: dict, servers: list[_Server], timeout: Optional[float]) -> None:
        """One bucket to every server of the group; a server that has not answered `join_grace(t)` after another
        answered (t: how long that one took, receive and load included) has not received the broadcast the others
        did: it is marked silent (out of this sync and of generation until it answers again) and named, instead of
        being waited for until `timeout`. The first refusal is raised as it comes."""
        t0 = time.monotonic()
        tasks = {asyncio.ensure_future(self._post_all("/update_weights_from_distributed", body, timeout=timeout,
                                                      servers=[s])): s for s in servers}
        pending, first = set(tasks), None
        try:
            while pending:
                wait = None if first is None else max(0.0, first[1] - time.monotonic())
                done, pending = await asyncio.wait(pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # a refusal or an unreachable server: raised now
                    self.bucket_answered.append(tasks[task].address)
                    if first is None:
                        took = time.monotonic() - t0
                        first = (tasks[task], time.monotonic() + join_grace(took), took)
                if pending and not done:  # the grace after the first answer ran out
                    late = [tasks[task] for task in pending]
                    waited = time.monotonic() - t0 - first[2]
                    for s in late:
                        self._mark_unhealthy(s, f"/update_weights_from_distributed: no answer {waited:.1f}s after "
                                             f"{first[0].address} had received the bucket", silent=True)
                    raise ServerError(f"{', '.join(s.address for s in late)}/update_weights_from_distributed: no "
                                      f"answer {waited:.1f}s after {first[0].address} had received and loaded the "
                                      f"bucket ({first[2]:.2f}s): not receiving the broadcast")
        finally:
            for task in pending:
                task.cancel()

    async def commit_distributed(self, group_name: str, version: int | str, *, flush_cache: bool = True,
                                 timeout: Optional[float] = None) -> list[str]:
        """The sync's commit: an empty /update_weights_from_distributed that sets `version` on every server of
        the group (SGLang sets weight_version only on success). Every bucket reached every server before it, so
        a server lost since (unreachable, answering 5xx, or a new process that no longer has this sync's session
        or group) is left out rather than failing the others: it is marked down or behind and comes back through
        recovery or the next sync. Returns the servers lost; raises ServerError for any other refusal, or when none is left."""
        body: dict[str, Any] = {"names": [], "dtypes": [], "shapes": [], "group_name": group_name,
                                "flush_cache": flush_cache, "weight_version": str(version)}
        servers = self._group if self._group is not None else self.sync_targets()
        lost: list[str] = []

        async def one(s: _Server) -> Optional[str]:
            try:
                status, out = await self._request("POST", s, "/update_weights_from_distributed", body,
                                                  timeout=timeout)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self._mark_unhealthy(s, f"commit: {_why(e)}", silent=True)
                lost.append(s.address)
                return None
            if status == 200 and not (isinstance(out, dict) and out.get("success") is False):
                return None
            msg = _error_message(out)
            if status >= 500:  # failing inside: down until it answers again, then behind
                self._mark_unhealthy(s, f"commit answered {status}: {msg[:200]}")
                lost.append(s.address)
                return None
            if status == 400 and _lost_state(msg) and await self._restarted(s, timeout):  # at launch weights
                lost.append(s.address)
                return None
            return f"{s.address}/update_weights_from_distributed answered {status}: {msg}"

        errors = [e for e in await asyncio.gather(*(one(s) for s in servers)) if e]
        if errors:
            raise ServerError("; ".join(errors))
        if servers and len(lost) == len(servers):
            raise ServerError(f"every server of the weight-update group was lost during the sync ({', '.join(lost)})")
        return lost

    async def _restarted(self, s: _Server, timeout: Optional[float]) -> bool:
        """s refused a sync's call for want of the session or group this sync set up on it: was it restarted (a
        new process, at a weight version other than the one this client last synced)? Then it is behind: True.
        Before the first sync every server is at its launch version: the refusal alone says it (nothing else
        closes a session or group this client opened)."""
        if self._served is None:
            self._set_behind(s, "its launch version (restarted during the first sync)")
            return True
        try:
            status, info = await self._request("GET", s, "/model_info", timeout=timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self._mark_unhealthy(s, f"/model_info: {_why(e)}", silent=True)
            return True
        have = info.get("weight_version") if status == 200 and isinstance(info, dict) else None
        if str(have) == self._served:
            return False
        logger.warning("server %s lost the weight-update session or group of this sync: restarted, at version %s",
                       s.address, have)
        self._set_behind(s, have)
        return True

    # ---- weight-update sessions (SGLang 0.5.21+) ------------------------------------------------
    async def learn_releases(self, timeout: Optional[float] = None) -> list[Release]:
        """Each server's SGLang release, asked once (`version` of /server_info, else /get_server_info).

        A server whose version cannot be read (None) learns whether it needs sessions from its first
        /begin_weight_update (404: a release before 0.5.21). Servers of different releases may serve one run:
        each is spoken to in its own protocol. A server that is down (unreachable or answering 5xx) is marked so
        and None in the list: it is asked again before its first weight update."""
        return await self._learn(self.servers, timeout, down_ok=True)

    async def _learn(self, servers: Sequence[_Server], timeout: Optional[float],
                     down_ok: bool = False, mark: bool = True) -> list[Optional[Release]]:
        """Each server's release, asked once. `mark`=False: a server that does not answer, or answers 5xx, is not
        marked down for it (a short look, not the sync's own call)."""
        async def one(s: _Server) -> Optional[Release]:
            if s.release is None:
                version: Any = None
                embedded = draft = False
                asked: list[str] = []  # each route's answer so far, for the error
                for path in ("/server_info", "/get_server_info"):
                    try:
                        status, out = await self._request("GET", s, path, timeout=timeout)
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                        if mark:
                            self._mark_unhealthy(s, f"{path}: {_why(e)}", silent=True)
                        if down_ok:
                            return None
                        raise ServerError(_failed(s, path, e)) from e
                    if status == 200 and isinstance(out, dict):
                        version, embedded = out.get("version"), out.get("embedded_server") is not None
                        draft = serves_draft(out)  # a NextN/EAGLE draft of the model's MTP layers
                        break
                    if status >= 500:
                        if mark:
                            self._mark_unhealthy(s, f"{path} answered {status}")
                        if down_ok:
                            return None
                    if status == 200:  # e.g. sglang-router: 404 to /server_info, a list or text to the other
                        asked.append(f"{path} answered 200 with {type(out).__name__}, not a JSON object")
                    else:
                        asked.append(f"{path} answered {status}: {_error_message(out)[:200]}")
                    if status != 404:
                        raise ServerError(f"{s.address}: cannot learn its SGLang release: {'; '.join(asked)} (a "
                                          "router in front of the servers? give the trainer the servers themselves)")
                s.release = Release.of(version, embedded, draft)
                why = untested_reason(version)
                if why and s.release.sessions is not None:
                    logger.warning("server %s: %s; speaking the protocol of its release line", s.address, why)
            return s.release

        return list(await asyncio.gather(*(one(s) for s in servers)))

    def mtp_plan(self) -> tuple[bool, Optional[str]]:
        """Whether this sync's servers take the model's MTP layers (`sglang_releases.mtp_plan`; releases learned)."""
        targets = self._group if self._group is not None else self.sync_targets()
        return mtp_plan([(s.address, s.release) for s in targets])

    async def begin_weight_update(self, selector: str = "all", timeout: Optional[float] = None) -> None:
        """Open a weight-update session on every server whose release needs one (POST /begin_weight_update).

        Raises ServerError naming the first server that refused; servers opened before it stay marked open,
        so the caller's `end_weight_update(check=False)` closes exactly those. A session left open by a trainer
        that died mid-sync is closed and opened again (SGLang refuses a second begin)."""
        targets = self._group if self._group is not None else self.sync_targets()
        await self._learn(targets, timeout)  # not the servers out of this sync (a down one would fail it)

        async def one(s: _Server) -> None:
            if s.release is not None and s.release.sessions is False:
                return
            for attempt in (0, 1):
                status, out = await self._control(s, "/begin_weight_update", {"selector": selector}, timeout)
                if status == 200 and not (isinstance(out, dict) and out.get("success") is False):
                    s.session_open = True
                    if s.release is None or s.release.sessions is None:
                        s.release = dataclasses.replace(s.release, sessions=True) if s.release else Release(None, True)
                    return
                if status == 404 and not (s.release and s.release.sessions):  # a release before 0.5.21
                    s.release = dataclasses.replace(s.release, sessions=False) if s.release else Release(None, False)
                    return
                msg = _error_message(out)
                if attempt == 0 and status == 400 and BEGIN_TWICE.split(";")[0] in msg:
                    logger.warning("server %s had a weight-update session open (a sync that died?): closing it",
                                   s.address)
                    await self._control(s, "/end_weight_update", {}, timeout)
                    continue
                raise ServerError(f"{s.address}/begin_weight_update answered {status}: {msg}")

        await asyncio.gather(*(one(s) for s in targets))

    async def end_weight_update(self, check: bool = True, timeout: Optional[float] = None) -> None:
        """Close the sessions this client opened (POST /end_weight_update: SGLang finalizes the load here).
        `check=False`: never raises (failure paths: every open session is closed, whatever else went wrong). A
        server that gave no answer since it last answered is not asked (it is out of this sync; its session stays
        marked open and its next /begin_weight_update closes and reopens it)."""
        async def one(s: _Server) -> Optional[str]:
            if not s.session_open or s.silent:  # one that gave no answer: its session is closed by the next begin
                return None
            try:
                status, out = await self._control(s, "/end_weight_update", {}, timeout)
            except ServerError as e:  # unreachable (now marked so): its session is unknown, tried again on the
                logger.warning("closing a weight-update session: %s", e)  # next close; a sync does not fail
                return None  # on it (a server that died has nothing to finalize; back, it joins a new group)
            s.session_open = False  # any answer: SGLang's end clears the session (or there was none)
            if status != 200 or (isinstance(out, dict) and out.get("success") is False):
                msg = _error_message(out)
                if status == 400 and _lost_state(msg) and await self._restarted(s, timeout):  # session gone
                    return None
                return f"{s.address}/end_weight_update answered {status}: {msg}"
            return None

        errors = [e for e in await asyncio.gather(*(one(s) for s in self.servers)) if e]
        if errors and check:
            raise ServerError("; ".join(errors))
        for e in errors:
            logger.warning("closing a weight-update session: %s", e)

    async def _control(self, s: _Server, path: str, body: Optional[dict], timeout: Optional[float],
                       method: str = "POST") -> tuple[int, Any]:
        try:
            status, out = await self._request(method, s, path, body, timeout=timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self._mark_unhealthy(s, f"{path}: {_why(e)}", silent=True)
            raise ServerError(_failed(s, path, e)) from e
        if status >= 500:
            self._mark_unhealthy(s, f"{path} answered {status}: {_error_message(out)[:200]}")
        return status, out

    async def weights_checksums(self, timeout: Optional[float] = None,
                                addresses: Optional[Sequence[str]] = None) -> list[dict]:
        """Each server's (`addresses`, default all) `/weights_checker {"action": "checksum"}` reply (SGLang
        0.5.18+; raises ServerError)."""
        targets = self._named(addresses) if addresses is not None else None
        return await self._post_all("/weights_checker", {"action": "checksum"}, timeout=timeout, servers=targets)

    @property
    def sessions_open(self) -> list[str]:
        """Servers with a weight-update session this client opened and has not closed."""
        return [s.address for s in self.servers if s.session_open]

    async def rollback_weights(self, timeout: Optional[float] = None,
                               addresses: Optional[Sequence[str]] = None) -> list[Any]:
        """Ask every server (`addresses`, default all) to drop the weight updates of the current pause (embedded
        servers restore the weights and version they had at /pause_generation; real SGLang has no such endpoint
        and answers 404). Never raises; the replies in the order of the servers, None for one that failed."""
        targets = self._named(addresses) if addresses is not None else self.servers
        return await self._post_all("/rollback_weights", {}, check=False, timeout=timeout, servers=targets)

    async def generate_on(self, index: int, payload: dict, timeout: Optional[float] = None) -> dict:
        """One raw /generate on server `index` (no retries, no resubmission): for probes and checks."""
        status, out = await self._request("POST", self.servers[index], "/generate", payload, timeout=timeout)
        if status != 200:
            raise ServerError(f"{self.servers[index].address}/generate answered {status}: {out}")
        return out

    async def destroy_weights_update_group(self, group_name: str, timeout: Optional[float] = None) -> None:
        """The group's members drop it (never raises: a dead member has lost it anyway, and one that gave no
        answer is not waited for again: back, it has a group nobody uses, replaced when it joins a new one)."""
        members, self._group = self._group, None
        await self._post_all("/destroy_weights_update_group", {"group_name": group_name}, check=False,
                             servers=self.answering(members if members is not None else self.servers),
                             timeout=timeout)

    async def server_info(self, timeout: Optional[float] = None,
                          addresses: Optional[Sequence[str]] = None) -> list[dict]:
        """Every server's (`addresses`, default all) GET /server_info (raises ServerError)."""
        async def one(s: _Server) -> dict:
            status, out = await self._control(s, "/server_info", None, timeout, method="GET")
            if status != 200 or not isinstance(out, dict):
                raise ServerError(f"{s.address}/server_info answered {status}: {_error_message(out)}")
            return out

        targets = self._named(addresses) if addresses is not None else self.servers
        return list(await asyncio.gather(*(one(s) for s in targets)))

    async def model_info(self, addresses: Optional[Sequence[str]] = None,
                         timeout: Optional[float] = None) -> list[dict]:
        async def one(s: _Server) -> dict:
            status, out = await self._control(s, "/model_info", None, timeout, method="GET")
            if status != 200:
                raise ServerError(f"{s.address}/model_info answered {status}")
            return out

        targets = self._named(addresses) if addresses is not None else self.servers
        return list(await asyncio.gather(*(one(s) for s in targets)))
