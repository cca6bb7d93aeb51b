"""Generation: /generate with AReaL's interruption loop (an aborted request waits while the client is paused, then
is sent again with its tokens so far), per-token weight versions, routed experts across segments, and the retry
rule (`retry_step`, a pure function of one attempt's outcome) around the send."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp

from mega_async.api.types import ModelRequest, ModelResponse, Version, WeightVersion
from mega_async.inference.client.pool import ServerPool
from mega_async.inference.client.transport import (BUSY, BUSY_WAIT_MAX_S, ServerError, ServerHung, _broken,
                                                   _error_message, _out_of_files, _Server, _why, classify_status)

logger = logging.getLogger("mega_async.inference.client")


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



SETTLE_QUIET_S = 2.0  # settle(): no reply for this long means what is left in flight is held by a paused server



def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class _SendGate:
    """One event loop's slots for /generate requests on the wire (the loop's connection budget), handed out only
    while the client is not paused. A request takes a slot before it picks a server and gives it back when its
    answer is in; one that finds no slot free, or the client paused, waits here in FIFO order, unsent and counted
    on no server. A slot freed while paused (the servers' abort answers) stays free until resume(): otherwise
    each abort answer would let a waiting request out to a paused server (which holds it), and the bracket would
    wait for as many new requests as aborts."""

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



@dataclass(frozen=True)
class Step:
    """What one /generate attempt's outcome decides (`retry_step`)."""
    action: str  # ACTIONS
    wait: float = 0.0  # seconds before the next attempt
    unstick: bool = False  # the request's next attempt may go to another server


# return: the answer is the request's; raise: no retry can help; resend: the same server again at once; wait:
# then the next attempt (the least loaded server again where `unstick`); out: the server (or router) gave no
# answer: taken out, then wait; ask: whether the server fails as a whole (/model_info) decides, asked again with
# `whole`; take_out: out of generation until it answers again, then at once elsewhere; wedged: out until a /generate
# answers again (its other calls answer), then at once elsewhere; router_down: generation goes around the router
# until it answers /health again, then at once
ACTIONS = ("return", "raise", "resend", "wait", "out", "ask", "take_out", "wedged", "router_down")
ROUTER_BUSY_S = 10.0  # a router busy (429/503) for longer than this is gone around, as a failing one is
ROUTER_HOLD_S = 30.0  # ... and held out this long before it is tried again


def retry_step(kind: str, *, attempt: int, resent: bool = False, count: int = 0, busy_for: float = 0.0,
               router: bool = False, whole: Optional[bool] = None, max_retries: int = 3, backoff: float = 0.2,
               request_timeout: float = 300.0, retry_after: Optional[float] = None,
               router_busy: float = ROUTER_BUSY_S) -> Step:
    """The retry rule for one /generate attempt. `kind`: ok, refused (another non-200 answer), emfile (this
    process is out of file descriptors), broken (the connection broke before any answer), no_answer, busy (429
    or 503: backpressure, never a failure), failed (5xx). `attempt`: attempts so far, this one included; `count`:
    the server's busy (kind busy) or 5xx (kind failed) answers in a row in time (answers to requests sent together
    count once), this one included; `busy_for`: seconds of busy answers in a row; `router`: the answer came from
    the router; `whole`: the answer to `ask`; `router_busy`: how long a busy router is waited for before
    generation goes around it (smg answers 503 while it trusts no worker)."""
    if kind == "ok":
        return Step("return")
    if kind == "refused":
        return Step("raise")
    if kind == "emfile":  # ours, not the server's: wait for descriptors to free up
        return Step("wait", backoff * min(attempt, 10))
    if kind == "broken" and not resent:  # most often a kept-alive connection the server had closed
        return Step("resend")
    if kind in ("broken", "no_answer"):
        return Step("out", backoff * min(attempt, 10), unstick=True)
    if kind == "busy":
        if count > max_retries and not router:  # down as a whole (restarting)? the router is only waited for
            if whole is None:
                return Step("ask")
            if whole:
                return Step("take_out", unstick=True)
        if router and busy_for > min(router_busy, request_timeout):
            return Step("router_down", unstick=True)
        if busy_for > request_timeout:
            return Step("raise")
        delay = retry_after if retry_after is not None else backoff * 2 ** min(attempt, 5)
        return Step("wait", min(max(delay, backoff), BUSY_WAIT_MAX_S), unstick=True)
    if kind == "failed":
        if count <= max_retries:
            return Step("wait", backoff * 2 ** min(count, 6))
        if router:  # around it to the servers until it answers /health again; never dropped
            return Step("router_down", unstick=True)
        if whole is None:
            return Step("ask")
        # out until its /model_info answers again; else a wedged engine behind a working front: out until a
        # /generate answers again
        return Step("take_out" if whole else "wedged", unstick=True)
    raise ValueError(f"unknown outcome {kind!r}")


def outcome(error: Optional[BaseException], status: int) -> str:
    """One attempt's outcome for `retry_step`."""
    if error is not None:
        if _out_of_files(error):
            return "emfile"
        return "broken" if _broken(error) else "no_answer"
    if status in BUSY:
        return "busy"
    if status >= 500:
        return "failed"
    return "ok" if status == 200 else "refused"


class Generation(ServerPool):
    """agenerate and its loop; the client-side pause (interrupted requests wait, unsent, until resume)."""

    def _init_generation(self, version: Optional[Version], max_resubmits: int, router_busy: float) -> None:
        self.max_resubmits = max_resubmits
        self.router_busy = router_busy  # seconds of busy answers from the router before generation goes around it
        self._version = version if version is not None else WeightVersion()  # read; owned by the weight sync
        self._pause_lock = threading.Lock()
        self._resumed: dict[asyncio.AbstractEventLoop, asyncio.Future] = {}  # per loop: set by resume()
        self._gates: dict[asyncio.AbstractEventLoop, _SendGate] = {}  # per event loop: /generate's send slots
        self._emfile_warned = 0.0

    def _gate(self) -> _SendGate:
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            for other in [x for x in self._gates if x.is_closed()]:
                del self._gates[other]
            gate = self._gates[loop] = _SendGate(self._connections, self._unpaused)
        return gate

    async def _generate_once(self, rid: str, payload: dict) -> tuple[dict, _Server]:
        """POST /generate with retries (`retry_step` decides each); reroutes to another server when one dies. A
        retry gets its own request id: the server may still hold the first attempt under the old one."""
        first_rid, attempt, resent, busy_since = payload["rid"], 0, False, None
        while True:
            payload["rid"] = first_rid if attempt == 0 else f"{first_rid}-r{attempt}"
            s, sent, error, status, body = await self._attempt(rid, payload)
            if error is None:
                s.last_answer = time.monotonic()
            kind = outcome(error, status)
            attempt += kind not in ("ok", "refused")
            now = time.monotonic()
            counted = kind in ("busy", "failed") and sent >= s.last_failure  # in a row in time, not in parallel
            if counted:
                s.last_failure = now
            if kind == "busy":
                busy_since, s.busy = busy_since or now, s.busy + counted
            elif error is None:
                busy_since = None
            s.failures += kind == "failed" and counted
            args = dict(kind=kind, attempt=attempt, resent=resent, count=s.busy if kind == "busy" else s.failures,
                        busy_for=now - (busy_since or now), router=s is self.router, max_retries=self.max_retries,
                        backoff=self.retry_backoff, request_timeout=self.request_timeout, retry_after=s.retry_after,
                        router_busy=self.router_busy)
            step = retry_step(**args)
            if step.action == "ask":
                step = retry_step(**args, whole=await self._failing_throughout(s))
            if step.action == "return":
                s.failures = s.busy = 0
                self._count_answer(s)
                return body, s
            if step.action == "raise":
                raise self._give_up(s, kind, status, body, now - (busy_since or now))
            resent = resent or step.action == "resend"
            self._act_on(step, s, kind, error, status, body, now - (busy_since or now))
            if step.unstick:
                self._sticky.pop(rid, None)
            if step.wait:
                await asyncio.sleep(step.wait)

    async def _attempt(self, rid: str, payload: dict) -> tuple[_Server, float, Optional[BaseException], int, Any]:
        """One send: a slot of this loop's (never taken while the client is paused), a server, the answer or the
        error. Returns (server, when it was sent, error, status, body)."""
        gate = self._gate()
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
            sent = time.monotonic()
            try:
                status, body = await self._cuttable(s, self._request("POST", s, "/generate", payload, resend=False))
                return s, sent, None, status, body
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
                return s, sent, e, 0, None
            finally:
                self._count(s, -1)
        finally:
            gate.release()

    def _act_on(self, step: Step, s: _Server, kind: str, error: Optional[BaseException], status: int,
                body: Any, busy_for: float) -> None:
        """What a retry step does to the server before the next attempt."""
        if step.action == "wait" and kind == "emfile" and time.monotonic() - self._emfile_warned > 10.0:
            self._emfile_warned = time.monotonic()
            logger.warning("out of file descriptors (%s); requests wait and retry", error)
        elif step.action == "wait" and kind == "busy" and time.monotonic() - s.busy_warned > 10.0:
            s.busy_warned = time.monotonic()
            logger.warning("server %s is busy (%s: %s); requests wait %.1f s and retry (not counted as failures)",
                           s.address, status, _error_message(body)[:120], step.wait)
        elif step.action == "out" and not isinstance(error, ServerHung):  # (a cut one's server is marked already)
            if s is self.router:
                self._router_down(_why(error))
            else:
                self._mark_unhealthy(s, _why(error), silent=True)
        elif step.action == "take_out" and kind == "busy" and s.healthy:
            self._mark_unhealthy(s, f"/generate answered {status} {s.busy} times in a row and /model_info fails too")
            s.busy = 0
        elif step.action == "router_down" and kind == "busy":
            self._router_down(f"/generate answered {status} (busy: {_error_message(body)[:120]}) for {busy_for:.0f} s")
            s.out_until, s.busy = time.monotonic() + ROUTER_HOLD_S, 0
        elif step.action in ("take_out", "wedged") and not s.healthy:
            pass  # another request's answer took it out meanwhile (while this one asked /model_info): said once
        elif step.action in ("take_out", "wedged", "router_down"):
            why = f"/generate answered {status} {s.failures} times in a row: {_error_message(body)[:200]}"
            if step.action == "router_down":
                self._router_down(why)
            elif step.action == "take_out":
                self._mark_unhealthy(s, why + " (and /model_info fails too)")
            else:
                self._mark_unhealthy(s, why + " while its /model_info answers: out until a /generate answers")
                s.wedged = True
            s.failures = 0

    def _give_up(self, s: _Server, kind: str, status: int, body: Any, busy_for: float) -> ServerError:
        if kind == "busy":
            return ServerError(f"{s.address}/generate answered {status} (busy: {_error_message(body)[:200]}) for "
                               f"{busy_for:.0f} s: raise the server's queue bound (--max-queued-requests) or lower "
                               "the rollout's concurrency")
        return classify_status(s.address, "/generate", status, body)

    def _count_answer(self, s: _Server) -> None:
        if self.router is not None:
            if s is self.router:
                self.router_answers += 1
            else:
                self.around_router_answers += 1

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

    async def generate_on(self, index: int, payload: dict, timeout: Optional[float] = None) -> dict:
        """One raw /generate on server `index` (no retries, no resubmission): for probes and checks."""
        status, out = await self._request("POST", self.servers[index], "/generate", payload, timeout=timeout)
        if status != 200:
            raise ServerError(f"{self.servers[index].address}/generate answered {status}: {out}")
        return out
