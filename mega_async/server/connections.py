"""Connections of the embedded server, bounded against slow and idle clients: connections that send half a request
must never take every file descriptor, so /health keeps answering whatever clients do.

- A request's header must arrive within `header_timeout` of the connection opening, or of its first byte on a
  kept-alive connection; its body within `body_timeout` of the handler starting to read it (after the API key).
  Idle kept-alive connections close after aiohttp's keep-alive timeout.
- At most `max_connections` are open (by default the open-file limit, raised to its hard limit, less the
  descriptors in use, two accept bursts and a margin): past it a new connection closes the one that has waited
  longest for a request or its body (never one whose handler runs: a generation, a stream, a weight update), so
  /health still gets in. Accepted sockets not yet counted are bounded too (`Listener`): accept() never fails with
  'Too many open files', which made asyncio stop accepting for a second at a time.
`serve` is `aiohttp.web.run_app` with these connections; `middlewares` go first in the app's list.
"""
from __future__ import annotations

import asyncio
import signal
import logging
import os
import resource
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

logger = logging.getLogger("mega_async.server")

BACKLOG = 128  # TCPSite's listen backlog: asyncio accepts up to this many at once, before any is counted
FD_MARGIN = 64  # descriptors beyond those in use at start kept free (weight files, update groups, logs)


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 30.0  # seconds to send a request's line and headers
    body_timeout: float = 60.0  # seconds to send a request's body, once the handler reads it
    max_connections: int = 0  # open at once; 0: from the open-file limit (see `connection_cap`)
    keepalive_timeout: float = 75.0  # seconds an idle kept-alive connection stays open (aiohttp's run_app default)
    max_body_bytes: int = 1 << 30  # request bodies held at once (received or being received), all connections

    def validate(self) -> None:
        for name in ("header_timeout", "body_timeout", "keepalive_timeout"):
            v = getattr(self, name)
            if not v > 0:  # NaN too
                raise ValueError(f"{name}={v}: must be a positive number of seconds")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={self.max_body_bytes}: must be at least 1 (bytes of request bodies held "
                             "at once)")
        if self.max_connections < 0:
            raise ValueError(f"max_connections={self.max_connections}: must be at least 0 (0: from the open-file "
                             "limit)")


def connection_cap(requested: int = 0) -> tuple[int, int]:
    """(cap, ceiling): connections open at once (`requested`, or the open-file limit, raised to its hard limit
    first, less the descriptors in use now, two accept bursts and a margin) and sockets held at once, counting
    those accepted but not yet connected (the limit less what is in use and the margin)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    soft = 1 << 20 if soft == resource.RLIM_INFINITY else soft
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 256
    ceiling = max(16, soft - in_use - FD_MARGIN)
    cap = min(requested, ceiling) if requested else max(8, ceiling - 2 * BACKLOG)  # room for two bursts
    return cap, ceiling


class Guard:
    """What the connections of one server share: how many are open and which may be closed for a newcomer. First
    the one that has waited longest after sending something (half a header, a body being read, an idle kept-alive
    connection): a slow client; only then one whose first bytes were not read yet (under load the server may take a
    while to read a whole /health request). OrderedDicts in the order they began to wait."""

    def __init__(self, limits: ConnectionLimits, cap: int, ceiling: int):
        self.limits, self.cap, self.ceiling = limits, cap, ceiling
        self.open = 0
        self.pending = 0  # accepted by the Listener, not yet connected
        self.waiting: OrderedDict[GuardedHandler, None] = OrderedDict()
        self.fresh: OrderedDict[GuardedHandler, None] = OrderedDict()  # nothing read from them yet
        self.closed = {"header": 0, "body": 0, "evicted": 0, "refused": 0}
        self._logged: Optional[float] = None

    def opened(self, h: "GuardedHandler") -> None:
        self.open += 1
        self.pending = max(0, self.pending - 1)
        self.fresh[h] = None
        if self.open > self.cap:  # the newcomer itself only when nothing else waits
            self.close(next(iter(self.waiting or self.fresh)), "evicted")

    def lost(self, h: "GuardedHandler") -> None:
        self.open -= 1
        self.busy(h)

    def wait(self, h: "GuardedHandler") -> None:
        self.busy(h)
        self.waiting[h] = None

    def busy(self, h: "GuardedHandler") -> None:
        self.waiting.pop(h, None)
        self.fresh.pop(h, None)

    def heard(self, h: "GuardedHandler") -> None:
        """Its first bytes were read: a slow client from now on, unless a handler takes it."""
        if self.fresh.pop(h, False) is None:
            self.waiting[h] = None

    def close(self, h: "GuardedHandler", why: str) -> None:
        """Close now: abort() frees the descriptor at once, even with a response the client is not reading."""
        self.busy(h)
        if h.transport is not None:
            h.transport.abort()
        h.force_close()
        self.note(why)

    def note(self, why: str) -> None:
        """Count a connection closed for `why`; one warning line at the first and then at most once a minute."""
        self.closed[why] += 1
        self.report()

    def report(self, final: bool = False) -> None:
        now = time.monotonic()
        if sum(self.closed.values()) and (final or self._logged is None or now - self._logged >= 60.0):
            c, lim = self.closed, self.limits
            logger.warning("closed %d connections since the last report: %d sent no request header within %gs, %d no "
                           "body within %gs, %d made room at the limit of %d open connections, %d refused at %d "
                           "sockets", sum(c.values()), c["header"], lim.header_timeout, c["body"], lim.body_timeout,
                           c["evicted"], self.cap, c["refused"], self.ceiling)
            self.closed = {k: 0 for k in c}
            self._logged = now


class GuardedHandler(RequestHandler):
    """aiohttp's connection with a header deadline and a place in the guard. Phases: "header" (the deadline runs),
    "body" (the handler reads it, under `read_body`'s deadline), "handling" (never closed by the guard), "idle"."""

    __slots__ = ("_guard", "_deadline", "_phase")

    def __init__(self, manager: Any, guard: Guard, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self._guard, self._deadline, self._phase = guard, None, "header"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()
        self._guard.opened(self)

    def data_received(self, data: bytes) -> None:
        if self._phase == "idle":  # the next request on a kept-alive connection begins
            self._phase = "header"
            self._arm()
            self._guard.wait(self)
        super().data_received(data)
        self._guard.heard(self)

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self._disarm()
        self._phase = "closed"
        self._guard.lost(self)
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = asyncio.get_running_loop().call_later(self._guard.limits.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self._phase == "header":
            self._guard.close(self, "header")

    def enter(self, phase: str) -> None:
        """From the middlewares: the request's header is in ("body"), its body too ("handling"), it is done ("idle")."""
        if self._phase == "closed":
            return
        self._phase = phase
        self._disarm()
        if phase == "handling":
            self._guard.busy(self)
        else:
            self._guard.wait(self)


class Listener(socket.socket):
    """The listening socket: a connection accepted past the guard's ceiling of sockets is closed at once."""

    guard: Guard

    def accept(self) -> tuple[socket.socket, Any]:
        while True:
            conn, addr = super().accept()  # BlockingIOError when none waits: asyncio's end of a burst
            g = self.guard
            if g.open + g.pending < g.ceiling:
                g.pending += 1
                return conn, addr
            conn.close()
            g.note("refused")


def listener(host: str, port: int, guard: Guard) -> Listener:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = Listener(family, kind, proto)
    sock.guard = guard
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


class GuardedServer(web.Server):
    def __init__(self, *args: Any, guard: Guard, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.guard = guard

    def __call__(self) -> RequestHandler:
        return GuardedHandler(self, self.guard, loop=self._loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """web.AppRunner whose connections are GuardedHandlers."""

    def __init__(self, app: web.Application, limits: ConnectionLimits, **kwargs: Any):
        super().__init__(app, keepalive_timeout=limits.keepalive_timeout, **kwargs)
        self.guard = Guard(limits, *connection_cap(limits.max_connections))

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # the app's startup ran; its handler and request factory
        return GuardedServer(plain.request_handler, request_factory=plain.request_factory,
                             handler_cancellation=plain.handler_cancellation, loop=plain._loop, guard=self.guard,
                             **plain._kwargs)


def _phase(request: web.Request, phase: str) -> None:
    enter = getattr(request.protocol, "enter", None)  # a plain aiohttp connection (tests' in-process runner): none
    if enter is not None:
        enter(phase)


def middlewares(limits: ConnectionLimits, authenticate: Any) -> list:
    """[track, authenticate, read_body]: `track` marks where the connection is (outermost), `read_body` reads the
    body of an authenticated request within `body_timeout` (408 and the connection closed past it), holding at
    most `max_body_bytes` of bodies at once over all connections: a body is counted from before its first byte is
    read (its Content-Length, or the app's client_max_size when unknown) until its handler ends; one that would
    pass the budget is answered 503 with Retry-After, unread (a lone body is always admitted, up to
    client_max_size). Without it, a thousand connections each sending 64 MiB would hold 64 GiB."""
    held = [0]

    @web.middleware
    async def track(request: web.Request, handler: Any) -> web.StreamResponse:
        _phase(request, "body")
        try:
            return await handler(request)
        finally:
            _phase(request, "idle")

    @web.middleware
    async def read_body(request: web.Request, handler: Any) -> web.StreamResponse:
        if not request.can_read_body:
            _phase(request, "handling")
            return await handler(request)
        size = request.content_length
        if size is None:
            size = request.app._client_max_size or limits.max_body_bytes
        if held[0] and held[0] + size > limits.max_body_bytes:
            resp = web.json_response({"error": f"server busy: {held[0] >> 20} MiB of request bodies held, this "
                                      f"one's {size >> 20} MiB would pass its {limits.max_body_bytes >> 20} MiB "
                                      "(--max-body-bytes); retry"}, status=503, headers={"Retry-After": "1"})
            resp.force_close()  # its body is never read
            return resp
        held[0] += size
        try:
            return await _read_then_handle(request, handler)
        finally:
            held[0] -= size

    async def _read_then_handle(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            await asyncio.wait_for(request.read(), limits.body_timeout)  # kept: request.json() reads it again
        except asyncio.TimeoutError:
            guard = getattr(request.protocol, "_guard", None)
            if guard is not None:
                guard.note("body")
            resp = web.json_response({"error": f"request body not received within {limits.body_timeout:g}s"},
                                     status=408)
            resp.force_close()
            await resp.prepare(request)
            await resp.write_eof()
            if request.transport is not None:  # flushed, then closed: no lingering read of the rest
                request.transport.close()
            return resp
        except web.HTTPException:  # 413 past client_max_size
            raise
        except Exception:  # noqa: BLE001 - a broken body: the handler reads it again and says so, as before
            pass
        _phase(request, "handling")
        return await handler(request)

    return [track, authenticate, read_body]


def serve(app: web.Application, host: str, port: int, limits: ConnectionLimits, shutdown_timeout: float = 5.0) -> None:
    """`web.run_app(app, host=host, port=port)` (signals, graceful shutdown, a client that disconnects cancels its
    handler) with guarded connections."""
    async def main() -> None:
        # SIGTERM/SIGINT end the wait below, so the graceful shutdown (on_shutdown answers every open request as
        # aborted, handlers get shutdown_timeout to finish) runs before asyncio.run cancels what is left; a signal
        # raised out of the loop (aiohttp's handle_signals) would cancel the open handlers first: no answer at all
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        runner = GuardedRunner(app, limits, handle_signals=False, handler_cancellation=True,
                               shutdown_timeout=shutdown_timeout)
        await runner.setup()
        try:
            await web.SockSite(runner, listener(host, port, runner.guard), backlog=BACKLOG).start()
            logger.info("connections: at most %d open (%d sockets); request header within %gs, body within %gs",
                        runner.guard.cap, runner.guard.ceiling, limits.header_timeout, limits.body_timeout)
            await stop.wait()
        finally:
            runner.guard.report(final=True)
            await runner.cleanup()

    try:
        asyncio.run(main())
    except (web.GracefulExit, KeyboardInterrupt):
        pass
