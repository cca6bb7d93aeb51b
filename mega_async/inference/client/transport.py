"""The client's wire: HTTP sessions per event loop (generation and control apart), one request with its bounds
(the answer's size, the timeout that names the server), SGLang's error bodies read into errors, and the record
of one server (`_Server`) that the other parts keep their state in."""
from __future__ import annotations

import asyncio
import codecs
import datetime
import email.utils
import errno
import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

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

from mega_async.api.sglang_releases import Release
from mega_async.api.types import FatalEngineError

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
    # when its last counted 5xx or busy answer came (monotonic): an answer counts toward `failures`/`busy` in a row
    # only for a request sent after it, so requests in flight together that fail together count once
    last_failure: float = -1e9
    wedged: bool = False  # out after 5xx answers while its /model_info answered: back once a /generate answers
    out_until: float = 0.0  # the router: gone around (busy for too long) until then, /health or not (monotonic)
    last_answer: float = 0.0  # when its last /generate answer came (monotonic; the router's watchdog reads it)



# idle keep-alive connections are dropped after this, before the server closes them (SGLang's uvicorn: 5 s), so a
# request never goes out on a connection the server is closing
KEEPALIVE_S = 4.0



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
    open files' (which would mark every server down)."""
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



class Transport:
    """HTTP to the servers: `_request` sends one call and returns (status, body) or raises (aiohttp's errors,
    ServerTimeout naming the server); it decides nothing about the server. Owns the sessions and the URL cache."""

    def _init_transport(self, api_key: Optional[str], request_timeout: float, connections: int) -> None:
        self.api_key = api_key
        self.request_timeout = request_timeout
        self._connections = connections  # /generate connections per event loop (the open-file budget)
        self._sessions: dict[asyncio.AbstractEventLoop, tuple] = {}  # per event loop: (generate, control)
        self._keepers: dict[asyncio.AbstractEventLoop, Any] = {}
        self._urls: dict[tuple[str, str], URL] = {}

    @staticmethod
    def _norm(a: str) -> str:
        return a.rstrip("/") if a.startswith("http") else f"http://{a.rstrip('/')}"

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
        update never queues behind thousands of generation requests waiting for a connection (a probe timing out
        in that queue would mark its server down)."""
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
                    server: Optional["_Server"] = None) -> tuple[int, Any]:
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
