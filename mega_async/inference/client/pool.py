"""The server pool: which servers serve (healthy, behind the synced weights, silent, dropped), the least-loaded
choice with sticky request ids, probes and re-admission at the synced weight version, the router in front, and
`_call`: the one place that says what a control call's failure means for its server."""
from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import threading
import time
from typing import Any, Optional, Sequence

import aiohttp

from mega_async.inference.client.transport import (NoHealthyServerError, ServerError, ServerHung, Transport, _Server,
                                                   _error_message, _failed, _why)

logger = logging.getLogger("mega_async.inference.client")


ROUTER_QUIET_S = 5.0  # the router gave no /generate answer this long: its /health is asked ...
ROUTER_PROBE_S = 3.0  # ... and must answer within this, twice in a row, else it is hung and gone around
ROUTER_PROBE_MISSES = 2  # (one slow answer on a loaded host is not a hung router)


class ServerPool(Transport):
    """Every server's state and the choice among them. The rules: a server that gives no answer is silent (out of
    generation and of clean-up calls until it answers); one answering 5xx is out until it answers again; one at
    another weight version than the last sync set is behind (out until recovered or synced); dropped is for good."""

    def _init_pool(self, addresses: Sequence[str], router: Optional[str], events: Any, *, max_retries: int,
                   retry_backoff: float, health_check_interval: float, unhealthy_timeout: float) -> None:
        self.events = events  # interruptions and servers behind, on the run's timeline
        self.servers = [_Server(self._norm(a)) for a in addresses]
        # a router in front of these servers (smg: docs/inference.md, "A router in front"): generation goes through
        # it while every server serves the current weights; control and weights always go straight to the servers
        self.router: Optional[_Server] = _Server(self._norm(router)) if router else None
        self._router_bypassed: Optional[str] = None  # why generation last went around the router (logged once)
        self.router_answers = self.around_router_answers = 0  # /generate answers through it, and around it
        self._dropped_any = False  # a server was dropped for good (then generation never goes through the router)
        self._finding: dict[asyncio.AbstractEventLoop, asyncio.Future] = {}  # per loop: the find_behind under way
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.health_check_interval = health_check_interval
        self.unhealthy_timeout = unhealthy_timeout
        self._unpaused = threading.Event()  # the client's own pause (Generation.pause/resume); readmission reads it
        self._unpaused.set()
        self._sticky: dict[str, _Server] = {}
        self._load: list[tuple[int, int]] = []  # heap of (in_flight, server index); stale entries skipped
        self._index = {id(s): i for i, s in enumerate(self.servers)}
        self._suspects: set[int] = set()  # indices of servers this client marked unhealthy (probed until back)
        self.moved: dict[str, str] = {}  # servers started again at another address: first address -> current one
        self._in_flight = 0  # over every server
        self._choosing = 0  # requests past their send slot whose server is being chosen (not counted on one yet)
        self._served: Optional[str] = None  # the weight_version this client's last weight sync set on the servers
        # async callable(address): brings one server that came back behind to the current weights (the run's
        # weight sync sets it; None: a behind server waits for the next sync, which includes it)
        self.recover: Any = None
        self._tasks: set = set()
        self._cut_lock = threading.Lock()  # guards every server's `generating` and `cut` (touched from two threads)
        self._router_watch: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}  # per loop: the router's watchdog
        self._rebuild_load()

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    async def _call(self, s: _Server, method: str, path: str, body: Any = None, timeout: Optional[float] = None,
                    *, what: Optional[str] = None, down_on_5xx: bool = True) -> tuple[int, Any]:
        """One control call to s, and the rule for what its failure says of s (`what` names the call in the
        reason): no answer (a timeout, a refused or broken connection) marks s silent and raises ServerError naming it
        (the only error it raises);
        a 5xx answer (`down_on_5xx`) takes s out of generation and of the next sync until it answers again, and is
        returned like any other answer."""
        what = what or path
        try:
            status, out = await self._request(method, s, path, body, timeout=timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            self._mark_unhealthy(s, f"{what}: {_why(e)}", silent=True)
            raise ServerError(_failed(s, path, e)) from e
        if status >= 500 and down_on_5xx:
            self._mark_unhealthy(s, f"{what} answered {status}: {_error_message(out)[:200]}")
        return status, out

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

    async def _probe_all(self, servers: list[_Server]) -> None:
        """Probe `servers` together; each is marked probed now, so the requests choosing a server at this moment do
        not probe it once each (a wedged server's probe is a /generate)."""
        now = time.monotonic()
        for s in servers:
            s.last_probe = now
        await asyncio.gather(*(self._probe(s) for s in servers))

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
        if s.wedged and not await self._generates(s):  # its other calls answered all along: generation must
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

    async def _generates(self, s: _Server) -> bool:
        """Whether a wedged server (5xx to /generate while its /model_info answered) answers a one-token /generate
        again (then it is no longer wedged)."""
        body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        try:
            status, _ = await self._request("POST", s, "/generate", body, timeout=10.0, resend=False)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False
        s.wedged = status != 200
        return not s.wedged

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
                status, info = await self._call(s, "GET", "/model_info", None, timeout, down_on_5xx=False)
            except ServerError:  # no answer (marked silent)
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
                    await self._probe_all(stale)
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
                await self._probe_all(stale)
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
            if time.monotonic() - r.last_probe < self.health_check_interval or time.monotonic() < r.out_until:
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
        self._watch_router()
        return r

    def _watch_router(self) -> None:
        """One watchdog per event loop while generation goes through the router: nothing but generation talks to
        it, so a router that hangs (a stopped process keeps accepting connections) would hold every request for
        `request_timeout`."""
        loop = asyncio.get_running_loop()
        task = self._router_watch.get(loop)
        if task is None or task.done():
            for other in [x for x in self._router_watch if x.is_closed()]:
                del self._router_watch[other]
            self._router_watch[loop] = loop.create_task(self._router_watchdog())

    async def _router_watchdog(self) -> None:
        """While requests wait on the router: once it has given no /generate answer for ROUTER_QUIET_S, its /health
        must answer within ROUTER_PROBE_S (ROUTER_PROBE_MISSES misses in a row), else it is hung: gone around (named in one line) and its requests cut, to
        go to the servers with their tokens so far."""
        r = self.router
        quiet = max(ROUTER_QUIET_S, 5 * self.health_check_interval)
        start, misses = time.monotonic(), 0
        while r is not None and r.healthy and r.in_flight > 0:
            await asyncio.sleep(self.health_check_interval)
            if time.monotonic() - max(r.last_answer, start) < quiet:
                continue
            try:
                await self._request("GET", r, "/health", timeout=ROUTER_PROBE_S)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                misses += 1
                if misses >= ROUTER_PROBE_MISSES and r.healthy:
                    self._router_down(f"/health: {_why(e)} ({misses} times) while {r.in_flight} requests waited "
                                      "on it")
                    self._cut_generation(r)
                    return
                continue
            start, misses = time.monotonic(), 0

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

    async def _failing_throughout(self, s: _Server) -> bool:
        """Whether a server whose /generate keeps answering 5xx fails its other calls too (unreachable, or /model_info
        answers 5xx): a server failing as a whole (overloaded, restarting, the fleet's `error` failure) is taken out
        and re-admitted once /model_info answers; one whose other calls answer has a wedged engine and is dropped."""
        try:
            status, _ = await self._request("GET", s, "/model_info", timeout=5.0)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return True
        return status >= 500

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
