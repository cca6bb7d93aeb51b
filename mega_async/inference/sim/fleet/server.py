"""One simulated SGLang server: the HTTP surface our client and sync use, over a timed model of a batcher.

Time, not tokens, is simulated: every running request advances on one progress clock whose rate is
1 / per-token latency at the current batch size, so a server costs O(log n) per request event, never per
token. Pauses are SGLang's: abort answers every request with its partial output (a resubmission of prompt
+ tokens so far continues with the same planned length and token stream); retract puts running requests
back in the queue (prefilled again at continue, under the new weights); in_place freezes them. Weight
updates are timed no-ops that set the version (and the `weight_versions` spans of requests they cut).
"""
from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import math
import socket
import time
import uuid
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from mega_async.inference.sim.fleet import control
from mega_async.inference.sim.fleet.model import (BadRequest, FleetConfig, SimRequest, TokenModel, dumps,
                                               version_number)
from mega_async.api.sglang_releases import Release

logger = logging.getLogger("mega_async.inference.sim.fleet")

MAX_CONTINUATIONS = 1 << 18
_EPS = 1e-6


class _Handler(RequestHandler):
    """A connection: as uvicorn (SGLang's HTTP server), an idle connection is closed `keepalive_s` after a
    response, never before its first request (aiohttp would close it keepalive_s after the connect)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._manager.sim.counters["connections"] += 1  # type: ignore[union-attr]
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
            self._keepalive_handle = None


class _HTTPServer(web.Server):
    sim: "SimServer"

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class Continuations:
    """What an aborted request was going to make, by the token ids a resubmission will send (prompt + tokens so
    far): shared by the servers of one process, bounded (oldest dropped)."""

    def __init__(self, limit: int = MAX_CONTINUATIONS):
        self._d: collections.OrderedDict[int, tuple[int, int, int, int]] = collections.OrderedDict()
        self.limit = limit

    def put(self, key: int, value: tuple[int, int, int, int]) -> None:
        self._d[key] = value
        if len(self._d) > self.limit:
            self._d.popitem(last=False)

    def pop(self, key: int) -> Optional[tuple[int, int, int, int]]:
        return self._d.pop(key, None)


class SimServer:
    """State and handlers of one server; `start()` binds its port, `crash()` and `restart()` simulate a process."""

    def __init__(self, index: int, cfg: FleetConfig, tokens: TokenModel, continuations: Continuations,
                 host: str = "127.0.0.1", port: int = 0):
        self.index, self.cfg, self.tokens, self.continuations = index, cfg, tokens, continuations
        self.host, self.port = host, port
        self.release = Release.of(cfg.sglang_version)
        if self.release.sessions is None:
            raise ValueError(f"sglang_version {cfg.sglang_version!r}: give a release such as 0.5.23")
        self.counters: collections.Counter[str] = collections.Counter()
        self.restarts = 0
        self.crashed = False
        self.hung = False
        self.slow = 1.0
        self.error_status: Optional[int] = None
        self._not_hung: Optional[asyncio.Event] = None
        self._srv: Optional[asyncio.AbstractServer] = None
        self._http: Optional[web.Server] = None
        self._seq = itertools.count()
        self._prefill = cfg.ttft_s / (cfg.token_latency_s + cfg.batch_latency_s)  # in tokens of the clock
        self.cache_epoch = 0
        self._routes = control.routes(self)
        self._fresh_process()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _fresh_process(self) -> None:
        """The state a (re)started SGLang process has: launch weights, nothing running, no group or session."""
        self.version = self.cfg.weight_version
        self.weights_id = f"launch:{self.cfg.seed}"
        self.live: dict[str, SimRequest] = {}
        self.running: dict[str, SimRequest] = {}
        self.waiting: collections.deque[SimRequest] = collections.deque()
        self._heap: list = []
        self.clock, self._clock_t, self._rate = 0.0, time.monotonic(), 0.0
        self._timer: Optional[asyncio.TimerHandle] = None
        self.paused: Optional[str] = None
        self.writers = 0  # updates outside a pause waiting for the running requests (SGLang's writer lock)
        self._waiters: list[asyncio.Future] = []
        self.groups: dict[str, dict] = {}
        self.session: Optional[str] = None
        self.cache_epoch += 1

    # ---- process lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._not_hung = self._not_hung or asyncio.Event()
        if not self.hung:
            self._not_hung.set()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self._http = _HTTPServer(self._handle, handler_cancellation=True, request_factory=self._make_request,
                                keepalive_timeout=self.cfg.keepalive_s, access_log=None)
        self._http.sim = self
        self._srv = await loop.create_server(self._http, sock=sock, backlog=4096)
        self.crashed = False

    def _make_request(self, message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
        return web.BaseRequest(message, payload, protocol, writer, task, asyncio.get_running_loop(),
                               client_max_size=256 << 20)

    def crash(self) -> None:
        """Stop answering: the port closes, open connections are reset, everything in flight is lost."""
        if self.crashed or self._srv is None:
            return
        self.crashed = True
        self.counters["crashes"] += 1
        self._srv.close()
        for h in self._http.connections if self._http else []:
            if h.transport is not None:
                h.transport.abort()
        if self._timer is not None:
            self._timer.cancel()
        for r in self.live.values():
            if not r.fut.done():
                r.fut.cancel()
        self._notify()
        self._fresh_process()

    async def restart(self) -> None:
        """Back after a crash, as a new process (its launch weights and version)."""
        if not self.crashed:
            return
        self.restarts += 1
        self._fresh_process()
        await self.start()

    async def stop(self) -> None:
        if self._srv is not None and not self.crashed:
            self._srv.close()
            if self._http is not None:
                for h in self._http.connections:
                    if h.transport is not None:
                        h.transport.abort()
        self.crashed = True

    def set_hung(self, on: bool) -> None:
        self.hung = on
        self._advance()
        if on:
            self._not_hung.clear()
        else:
            self._not_hung.set()
            self._admit()
        self._reschedule()

    def set_slow(self, factor: float) -> None:
        self._advance()
        self.slow = factor
        self._reschedule()

    # ---- HTTP ----------------------------------------------------------------------------------
    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if self.hung:
            await self._not_hung.wait()
        path = request.path
        if self.cfg.api_key and not path.startswith("/health") and \
                request.headers.get("Authorization", "") != f"Bearer {self.cfg.api_key}":
            return self._json({"error": "Unauthorized"}, 401)
        if self.error_status is not None and not path.startswith("/health"):
            self.counters["errors_answered"] += 1
            return self._json({"object": "error", "message": "simulated server error (fleet failure schedule)",
                               "type": "InternalServerError", "param": None, "code": self.error_status},
                              self.error_status)
        route = self._routes.get(path)
        if route is None:
            return self._json({"object": "error", "message": "Not Found", "type": "404", "param": None,
                               "code": 404}, 404)
        methods, fn = route
        if request.method not in methods:
            return self._json({"object": "error", "message": "Method Not Allowed", "type": "405", "param": None,
                               "code": 405}, 405)
        try:
            out = await fn(request)
        except BadRequest as e:
            out = ({"error": {"message": str(e)}}, 400)
        if self.hung:  # an answer that became ready during a hang waits for its end
            await self._not_hung.wait()
        if isinstance(out, web.StreamResponse):
            return out
        body, status = out
        return self._json(body, status)

    @staticmethod
    def _json(body: Any, status: int = 200) -> web.Response:
        """`body` as JSON (bytes: JSON text already, e.g. a /generate answer)."""
        return web.Response(body=body if isinstance(body, bytes) else dumps(body), status=status,
                            content_type="application/json")

    async def body(self, request: web.BaseRequest, required: bool = True) -> dict:
        raw = await request.read()
        if not raw:
            if required:
                raise BadRequest("request body required (send {} at least)")
            return {}
        try:
            import json

            body = json.loads(raw)
        except ValueError as e:
            raise BadRequest(f"invalid JSON body: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("JSON body must be an object")
        return body

    # ---- gates ---------------------------------------------------------------------------------
    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def wait_until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            f = asyncio.get_running_loop().create_future()
            self._waiters.append(f)
            await f

    def admitting(self) -> bool:
        return self.paused is None and self.writers == 0

    async def exclusive(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run fn now when paused, else after the running requests finished, new ones held (SGLang's writer
        lock around an update outside a pause)."""
        if self.paused is not None:
            return await fn()
        self.writers += 1
        try:
            await self.wait_until(lambda: not self.live)
            return await fn()
        finally:
            self.writers -= 1
            self._notify()
            self._step()

    # ---- the clock -----------------------------------------------------------------------------
    def _advance(self) -> None:
        now = time.monotonic()
        self.clock += (now - self._clock_t) * self._rate
        self._clock_t = now

    def _reschedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        frozen = self.paused is not None or self.hung or self.crashed or not self.running
        self._rate = 0.0 if frozen else 1.0 / self.tokens.token_latency(len(self.running), self.slow)
        h = self._heap
        while h and (h[0][3] != h[0][2].gen or not h[0][2].running):
            heapq.heappop(h)
        if h and self._rate > 0:
            delay = max(0.0, (h[0][0] - self.clock) / self._rate)
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _step(self) -> None:
        self._advance()
        self._admit()
        self._reschedule()

    def produced(self, r: SimRequest) -> int:
        if not r.running:
            return r.base
        return min(r.target, r.base + max(0, math.floor(self.clock - r.p0 + _EPS)))

    def _admit(self) -> None:
        if self.paused is not None or self.hung or self.crashed:
            return
        cap = self.cfg.max_running_requests
        while self.waiting and len(self.running) < cap:
            r = self.waiting.popleft()
            r.running, r.gen = True, r.gen + 1
            r.p0 = self.clock + self._prefill
            self.running[r.rid] = r
            heapq.heappush(self._heap, (r.p0 + r.target - r.base, next(self._seq), r, r.gen))

    def _on_timer(self) -> None:
        self._timer = None
        self._advance()
        h = self._heap
        while h and h[0][0] <= self.clock + _EPS:
            _, _, r, gen = heapq.heappop(h)
            if gen == r.gen and r.running:
                self.finish(r, None)
        self._admit()
        self._reschedule()

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, r: SimRequest) -> None:
        self.live[r.rid] = r
        self.waiting.append(r)
        self.counters["requests"] += 1
        self._step()

    def drop(self, r: SimRequest) -> None:
        """The client went away (timeout, disconnect): the request is aborted without an answer."""
        if self.live.pop(r.rid, None) is None:
            return
        self._advance()
        if r.running:
            r.base, r.running = self.produced(r), False
            self.running.pop(r.rid, None)
        else:
            try:
                self.waiting.remove(r)
            except ValueError:
                pass
        self.counters["dropped"] += 1
        self._notify()
        self._step()

    def finish(self, r: SimRequest, abort: Optional[str]) -> None:
        """Answer r: complete (abort None) or aborted with its partial output (the caller advanced the clock)."""
        n = self.produced(r)
        if abort is not None and n >= r.target > 0:
            abort = None  # it had made all its tokens (its finish was due): it finishes, as on SGLang
        was_running = r.running
        r.base, r.running = n, False
        self.running.pop(r.rid, None)
        self.live.pop(r.rid, None)  # a waiting request: the caller takes it out of the queue
        ids = self.tokens.tokens(r.offset, n)
        if abort is None:
            if r.target < r.planned or r.stop is None:
                fr: dict = {"type": "length", "length": n}
            else:
                ids[-1] = r.stop
                fr = {"type": "stop", "matched": r.stop}
            self.counters["finished"] += 1
        else:
            fr = {"type": "abort", "message": abort}
            self.counters["aborted"] += 1
            key = hash(tuple(r.input_ids) + tuple(ids))
            self.continuations.put(key, (r.planned - n, r.offset + n, self.index, self.cache_epoch))
        self.counters["tokens"] += n
        if not r.fut.done():
            r.fut.set_result(self._response(r, ids, fr, waiting_abort=abort is not None and not was_running
                                            and n == 0))
        if not self.live:
            self._notify()

    def _response(self, r: SimRequest, ids: list, fr: dict, waiting_abort: bool) -> bytes:
        """The /generate answer as JSON text (its logprobs are spliced in from the token model's tables)."""
        n = len(ids)
        spans, spans_out = [], []
        marks = r.marks
        for i, (a, v) in enumerate(marks):
            b = marks[i + 1][0] if i + 1 < len(marks) else n
            a, b = min(a, n), min(b, n)
            if b > a:
                spans.append((a, b, version_number(v)))
                spans_out.append({"version": v, "start": a, "end": b})
        if not spans_out:
            spans_out = [{"version": self.version, "start": 0, "end": 0}]
        if waiting_abort:
            fr = {"type": "abort", "message": "Abort in waiting queue"}
        meta = {"id": r.rid, "finish_reason": fr, "prompt_tokens": 0 if waiting_abort else len(r.input_ids),
                "completion_tokens": n, "cached_tokens": r.cached, "weight_version": spans_out[-1]["version"],
                "weight_versions": spans_out, "e2e_latency": time.monotonic() - r.t0}
        head = dumps({"text": "", "output_ids": ids, "meta_info": meta})  # ends with the two closing braces
        if not r.logprobs:
            return head
        return b"".join((head[:-2], b',"output_token_logprobs":', self.tokens.logprob_json(r.offset, ids, spans),
                         b',"input_token_logprobs":[]}}'))

    def abort_live(self, message: str = "Aborted", rid: Optional[str] = None) -> int:
        self._advance()
        if rid is None:
            hit = list(self.live.values())
            self.waiting.clear()
        else:
            hit = [self.live[rid]] if rid in self.live else []
            if hit and not hit[0].running:
                self.waiting.remove(hit[0])
        for r in hit:
            self.finish(r, message)
        self._step()
        return len(hit)

    def retract(self) -> None:
        """Running requests go back to the head of the queue, keeping their tokens (their KV is dropped)."""
        self._advance()
        for r in reversed(list(self.running.values())):
            r.base, r.running = self.produced(r), False
            self.waiting.appendleft(r)
        self.running.clear()
        self._reschedule()

    def set_version(self, v: str) -> None:
        """New weights: tokens from here on carry v (live requests get a span boundary at their next token)."""
        self._advance()
        for r in self.live.values():
            r.mark(self.produced(r), v)
        self.version = v

    def flushable(self) -> bool:
        """SGLang's flush runs only when idle (a paused engine ignores its waiting queue)."""
        return not self.running and (self.paused is not None or not self.waiting)

    def flush(self) -> bool:
        if not self.flushable():
            return False
        self.cache_epoch += 1
        return True

    def pause(self, mode: str) -> int:
        """SGLang's /pause_generation; returns how many requests were aborted (abort mode)."""
        self.paused = mode
        aborted = 0
        if mode == "abort":
            aborted = self.abort_live()
        elif mode == "retract":
            self.retract()
        else:
            self._advance()
            self._reschedule()
        return aborted

    def resume(self) -> None:
        self._advance()
        self.paused = None
        self._notify()
        self._step()

    def state(self) -> dict[str, Any]:
        self._advance()  # the clock to now: running_tokens is what the running requests have made so far
        return {"index": self.index, "address": self.address, "version": self.version, "paused": self.paused,
                "running": len(self.running), "running_tokens": sum(self.produced(r) for r in self.running.values()),
                "waiting": len(self.waiting), "crashed": self.crashed,
                "hung": self.hung, "slow": self.slow, "error_status": self.error_status, "restarts": self.restarts,
                "groups": sorted(self.groups), "session": self.session, "counters": dict(self.counters)}

    def new_rid(self) -> str:
        return uuid.uuid4().hex
