"""One fleet process: many simulated servers on one event loop (each on its own port), their failure schedule,
and an admin endpoint (`/fleet/state`, `/fleet/fail`, `/fleet/recover`) to inspect them and fail them by hand."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional, Sequence

from aiohttp import web

from mega_async.inference.sim.fleet.model import FleetConfig, TokenModel
from mega_async.inference.sim.fleet.schedule import KINDS, FailureEvent
from mega_async.inference.sim.fleet.server import Continuations, SimServer, dumps

logger = logging.getLogger("mega_async.inference.sim.fleet")


class FleetHost:
    """Servers `indices` of a fleet; `epoch` (time.time()) is the moment the schedule's `at` counts from."""

    def __init__(self, cfg: FleetConfig, indices: Sequence[int], host: str = "127.0.0.1",
                 ports: Optional[Sequence[int]] = None, schedule: Sequence[FailureEvent] = (),
                 epoch: Optional[float] = None):
        tokens, conts = TokenModel(cfg), Continuations()
        self.tokens = tokens  # shared by every server of the host
        ports = list(ports) if ports is not None else [0] * len(indices)
        self.servers = {i: SimServer(i, cfg, tokens, conts, host, p) for i, p in zip(indices, ports)}
        self.host = host
        self.schedule = [e for e in schedule if e.server in self.servers]
        self.epoch = epoch if epoch is not None else time.time()
        self.admin_port = 0
        self._runner: Optional[web.AppRunner] = None
        self._handles: list[asyncio.TimerHandle] = []
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        for s in self.servers.values():
            await s.start()
        app = web.Application()
        app.router.add_get("/fleet/state", self._state)
        app.router.add_post("/fleet/fail", self._fail)
        app.router.add_post("/fleet/recover", self._recover)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.admin_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        loop = asyncio.get_running_loop()
        for e in self.schedule:
            delay = max(0.0, self.epoch + e.at - time.time())
            self._handles.append(loop.call_later(delay, lambda e=e: self._spawn(self.fail(e))))
        logger.info("fleet host: %d servers on %s, admin port %d, %d scheduled failures", len(self.servers),
                    self.host, self.admin_port, len(self.schedule))

    async def stop(self) -> None:
        for h in self._handles:
            h.cancel()
        for s in self.servers.values():
            await s.stop()
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers.values()]

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ---- failures ------------------------------------------------------------------------------
    async def fail(self, e: FailureEvent) -> None:
        s = self.servers[e.server]
        logger.warning("fleet server %d (%s): %s%s", e.server, s.address, e.kind,
                       f" for {e.duration:g}s" if e.duration else " for good")
        if e.kind == "crash":
            s.crash()
        elif e.kind == "hang":
            s.set_hung(True)
        elif e.kind == "slow":
            s.set_slow(e.factor)
        else:
            s.error_status = e.status
        if e.duration is not None:
            await asyncio.sleep(e.duration)
            await self.recover(e.server, e.kind)

    async def recover(self, index: int, kind: Optional[str] = None) -> None:
        """End a failure now (kind None: every one): a crashed server restarts as a new process."""
        s = self.servers[index]
        if kind in (None, "crash") and s.crashed:
            await s.restart()
            logger.warning("fleet server %d (%s) restarted at version %s", index, s.address, s.version)
        if kind in (None, "hang") and s.hung:
            s.set_hung(False)
        if kind in (None, "slow"):
            s.set_slow(1.0)
        if kind in (None, "error"):
            s.error_status = None

    # ---- admin ---------------------------------------------------------------------------------
    async def _state(self, request: web.Request) -> web.Response:
        return web.Response(body=dumps([s.state() for s in self.servers.values()]), content_type="application/json")

    async def _body_server(self, request: web.Request) -> tuple[dict, int]:
        body = await request.json()
        index = int(body.get("server", -1))
        if index not in self.servers:
            raise web.HTTPBadRequest(text=f"server {index} is not served by this fleet process")
        return body, index

    async def _fail(self, request: web.Request) -> web.Response:
        body, index = await self._body_server(request)
        kind = body.get("kind")
        if kind not in KINDS:
            raise web.HTTPBadRequest(text=f"kind {kind!r}: use one of {KINDS}")
        e = FailureEvent(index, 0.0, kind, body.get("duration"), float(body.get("factor", 10.0)),
                         int(body.get("status", 503)))
        if e.duration is None:
            await self.fail(e)
        else:
            self._spawn(self.fail(e))
            await asyncio.sleep(0)
        return web.json_response(self.servers[index].state())

    async def _recover(self, request: web.Request) -> web.Response:
        body, index = await self._body_server(request)
        await self.recover(index, body.get("kind"))
        return web.json_response(self.servers[index].state())
