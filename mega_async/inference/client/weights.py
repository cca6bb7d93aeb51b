"""The weight-update control plane: pause and continue, abort in flight, the weight-update group and its buckets,
the commit that sets the version, sessions (SGLang 0.5.21+), checksums and rollback; every call straight to the
servers (never through a router), each server's failure handled by the pool's `_call`."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Optional, Sequence

import aiohttp

from mega_async.api.sglang_releases import (BEGIN_TWICE, END_WITHOUT_BEGIN, Release, mtp_plan, serves_draft,
                                            session_refusal, untested_reason)
from mega_async.inference.client.pool import ServerPool
from mega_async.inference.client.transport import ServerError, _Server, _error_message, _failed

logger = logging.getLogger("mega_async.inference.client")


REABORT_S = 0.1  # abort_in_flight: /abort_request again this often to a server whose requests are not all back



# a bucket's receivers finish its broadcast together: one still silent this long after another answered (and at
# least as long again as that one took, receive and load included) is not receiving it (hung, or never joined)
JOIN_GRACE_S = 3.0



def join_grace(first_took: float) -> float:
    """How long the other servers of a bucket get after the first one answered."""
    return max(JOIN_GRACE_S, first_took)


def _lost_state(message: str) -> bool:
    """A server's refusal saying it no longer has the session or group this sync opened on it: the process was
    restarted during the sync (a new one has neither) and holds its launch weights."""
    return (END_WITHOUT_BEGIN in message or session_refusal("update_weights_from_distributed") in message
            or "no weight update group" in message)



class WeightControl(ServerPool):
    """The sync's calls to the servers; returns plain values and raises ServerError naming the server."""

    def _init_weights(self) -> None:
        self._group: Optional[list[_Server]] = None  # the servers of the current weight-update group
        self.bucket_answered: list[str] = []  # the servers that answered the bucket being sent (the sync reads it)

    # ---- control, to all servers concurrently -----------------------------------------------
    async def _post_all(self, path: str, body: dict, *, check: bool = True, only_healthy: bool = False,
                        bodies: Optional[list[dict]] = None, timeout: Optional[float] = None,
                        servers: Optional[list[_Server]] = None) -> list[Any]:
        targets = servers if servers is not None else [s for s in self.servers if s.healthy or not only_healthy]

        async def one(i: int, s: _Server) -> Any:
            try:
                status, out = await self._call(s, "POST", path, bodies[i] if bodies else body, timeout)
            except ServerError:  # no answer (marked silent)
                if check:
                    raise
                return None
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
                status, out = await self._call(s, "POST", "/update_weights_from_distributed", body, timeout,
                                               what="commit")
            except ServerError:  # no answer (marked silent)
                lost.append(s.address)
                return None
            if status == 200 and not (isinstance(out, dict) and out.get("success") is False):
                return None
            msg = _error_message(out)
            if status >= 500:  # failing inside (now down): back, it is behind
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
            status, info = await self._call(s, "GET", "/model_info", None, timeout, down_on_5xx=False)
        except ServerError:  # no answer (marked silent)
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
                mtp_kept = True
                asked: list[str] = []  # each route's answer so far, for the error
                for path in ("/server_info", "/get_server_info"):
                    try:
                        status, out = await (self._call(s, "GET", path, None, timeout, down_on_5xx=False) if mark
                                             else self._request("GET", s, path, timeout=timeout))
                    except ServerError:  # no answer (marked silent)
                        if down_ok:
                            return None
                        raise
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:  # a look: not marked
                        if down_ok:
                            return None
                        raise ServerError(_failed(s, path, e)) from e
                    if status == 200 and isinstance(out, dict):
                        version, embedded = out.get("version"), out.get("embedded_server") is not None
                        draft = serves_draft(out)  # a NextN/EAGLE draft of the model's MTP layers
                        mtp_kept = bool(out.get("mtp_layers_kept", 1))  # the embedded server's
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
                s.release = Release.of(version, embedded, draft, mtp_kept)
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
                status, out = await self._call(s, "POST", "/begin_weight_update", {"selector": selector}, timeout)
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
                    await self._call(s, "POST", "/end_weight_update", {}, timeout)
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
                status, out = await self._call(s, "POST", "/end_weight_update", {}, timeout)
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
            status, out = await self._call(s, "GET", "/server_info", None, timeout)
            if status != 200 or not isinstance(out, dict):
                raise ServerError(f"{s.address}/server_info answered {status}: {_error_message(out)}")
            return out

        targets = self._named(addresses) if addresses is not None else self.servers
        return list(await asyncio.gather(*(one(s) for s in targets)))

    async def model_info(self, addresses: Optional[Sequence[str]] = None,
                         timeout: Optional[float] = None) -> list[dict]:
        async def one(s: _Server) -> dict:
            status, out = await self._call(s, "GET", "/model_info", None, timeout)
            if status != 200:
                raise ServerError(f"{s.address}/model_info answered {status}")
            return out

        targets = self._named(addresses) if addresses is not None else self.servers
        return list(await asyncio.gather(*(one(s) for s in targets)))
