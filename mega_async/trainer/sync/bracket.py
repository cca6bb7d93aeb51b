"""Weight sync: the trainer's new weights onto the inference servers; the one owner of the weight version.

    push(): [disk: export HF dir] -> pause bracket { [distributed: resharder buckets -> POST + broadcast]
            [disk: servers load the dir] -> version += 1 } -> [verify: probe logprobs equal the trainer's]

The bracket (`WeightSync`) holds a transport (`Transport`: disk.py's directories, distributed.py's broadcast) and
runs its phases in one runner for a push and for a catch-up; the transport does each phase's work and keeps no
version of its own.

Three pauses, one bracket (`pause_bracket`), entered in this order and left in reverse in `finally`,
so no failure leaves anything paused: (1) the executor stops admitting new episodes (running ones go
on); (2) the client holds every interrupted request instead of resubmitting it; (3) the servers pause
in abort mode, which answers in-flight requests with their partial output. After the update the
client resubmits prompt + tokens so far, and the new tokens carry the new version.

Every trainer rank calls `push()` (SPMD). The DP head (global rank 0) owns the bracket and the
rollout side; each pipeline stage head owns one weight-update group with the servers (built as
SGLang builds it) and streams its own stage. Failures are agreed across ranks, servers are rolled
back and continued, the version is left unchanged and `SyncError` is raised on every rank.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from mega_async.utils.events import NullEventLog
from mega_async.trainer.sync.common import INTERRUPT_MODES, HttpLoop, RolloutSide, SyncError
from mega_async.trainer.sync.servers import ServerCalls
from mega_async.trainer.sync.verify import Verifier
from mega_async.utils.comm import agree, from_rank0, rank
from mega_async.api.types import WeightVersion

logger = logging.getLogger("mega_async.trainer.sync")

# a push that fails because servers went down during it is done again without them, this many times in all (each
# retry needs a server lost in the attempt before it; any other failure is raised at once). Each crash after the
# group is built costs one attempt, so the bound allows several crashes within one push
PUSH_ATTEMPTS = 8
# interrupt=abort: how long the bracket waits for the requests it aborted to come back before it pauses the servers
# (what is still out then, the pause aborts again and SGLang's own pause waits for, once a second)
ABORT_DRAIN_S = 5.0


@contextlib.contextmanager
def no_gc_pass() -> Iterator[None]:
    """No automatic cyclic-GC pass while the servers are paused. With tens of thousands of episodes in flight the
    controller holds millions of objects, and one full pass takes about a second per million (0.95 s at 12,000
    in flight, measured in `tools/bench_scale.py`'s controller), landing inside the bracket at random. The pass
    runs after the bracket, when Python's thresholds next call for it (torchtitan likewise keeps the collector
    off the critical path)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass
class SyncContext:
    """What the bracket shares with its transport, on every rank. `rollout` and `servers` (rank 0's HTTP side) are
    None on the other ranks, which hear rank 0's decisions through `decide`."""

    models: list
    version: WeightVersion  # read by the transport; only the bracket sets it
    rollout: Optional[RolloutSide]
    servers: Optional[ServerCalls]
    loop: HttpLoop
    group: Any  # for the small agreements between ranks (a gloo group with a long timeout)
    timeout: float
    flush_cache: bool  # SGLang 0.5.21+ fails an update whose flush finds requests (interrupt=in_place keeps them)
    events: Any

    def decide(self, decision: Callable[[], Any]) -> Any:
        """One decision: rank 0 makes it from the servers' answers (`decision()`), every rank gets it."""
        return from_rank0(decision() if self.servers is not None else None, self.group)


class Transport:
    """How the weights travel to the servers. The bracket calls, on every rank: `open` once; per push `members`,
    then the phases 1. `prepare` (before the pause) 2. `begin` 3. `update` 4. `commit` 5. `end` (inside it, each
    agreed across ranks; a phase returns this rank's error or None), and on a failure `abort`, `rollback`,
    `end_quietly`, `after_failure`; `close` at the end. A transport that `catches_up` brings a server that came back
    behind to the current weights between steps (`due`, `settle`, `rebuild`)."""

    sends_new_weights = True  # every push sends weights that differ from the last (a training step ran)
    catches_up = False
    fp8_block: Optional[tuple[int, int]] = None  # FP8 block quantization on the way (the verifier must know)
    ctx: SyncContext

    def open(self, ctx: SyncContext) -> None:
        """Every rank, once: the shared parts; a transport builds what it needs (raises SyncError, cleaned up)."""
        self.ctx = ctx
        self.figures: dict[str, float] = {}  # the last push's own figures (bytes, buckets, export_s, ...)

    def members(self) -> None:
        """Before a push (every rank): the distributed transport rebuilds its group when the servers changed."""

    def prepare(self, target: int) -> None:
        """1. Work done before the pause (disk: write the checkpoint)."""

    def begin(self, target: int) -> Optional[str]:
        """2. Inside the bracket, before any weight moves (distributed: open the servers' weight-update sessions)."""
        return None

    def update(self, target: int) -> Optional[str]:
        """3. Send the weights."""
        raise NotImplementedError

    def commit(self, target: int) -> Optional[str]:
        """4. After every rank succeeded (distributed: the version is set on the servers only now)."""
        return None

    def end(self, target: int) -> Optional[str]:
        """5. After the commit (distributed: close the sessions; SGLang finalizes the load there)."""
        return None

    def abort(self) -> None:
        """Right after a failure, before the rollback (distributed: drop this rank's side of the group)."""

    def rollback(self, targets: Sequence[str]) -> Optional[str]:
        """Rank 0 asks the servers `targets` to drop this sync; returns what went wrong (None: all rolled back)."""
        return self.ctx.servers.rollback(targets) if self.ctx.servers is not None else None

    def end_quietly(self) -> None:
        """On every failure path, after the rollback: close whatever session is still open; never raises."""

    def after_failure(self) -> None:
        """Clean-up after a failed sync (distributed: the groups may be broken)."""

    @contextlib.contextmanager
    def pushing(self) -> Iterator[None]:
        """Around a whole push, its retries included (disk: a server back meanwhile waits for it)."""
        yield

    def after_push(self) -> None:
        """After a successful push (disk: the old versions' directories go)."""

    def waiting(self) -> bool:
        """Rank 0: a server waits to be caught up (asks nothing, changes nothing)."""
        return False

    def due(self) -> Optional[list[str]]:
        """Rank 0: the servers to catch up now (those waiting that no longer need it are let go)."""
        return None

    def settle(self, addresses: Optional[Sequence[str]] = None) -> None:
        """Rank 0: the servers `addresses` (None: all) stop waiting to be caught up."""

    def rebuild(self, addresses: list[str]) -> None:
        """Every rank: the weight path over exactly `addresses` (a catch-up's own group)."""

    def close(self) -> None:
        """Every rank, at the end."""


class WeightSync:
    """The one owner of the weight version and of the pause bracket; runs its transport's phases (`push`, and
    `catch_up` for a transport that catches up) and its `Verifier`'s check after each push. Rank 0 holds the
    servers' HTTP side (`servers`, None on the other ranks)."""

    def __init__(self, models: Sequence[torch.nn.Module], version: WeightVersion, rollout: Optional[RolloutSide],
                 transport: Transport, *, timeout: float = 300.0,
                 verify: Optional[Callable[[dict], torch.Tensor]] = None, verify_tol: float = 1e-4,
                 temperature: float = 1.0, group: Any = None, events: Any = None, verify_method: str = "auto",
                 interrupt: str = "abort"):
        if interrupt not in INTERRUPT_MODES:
            raise ValueError(f"interrupt={interrupt!r}: use one of {INTERRUPT_MODES}")
        self.interrupt = interrupt
        self.events = events if events is not None else NullEventLog()  # phases on the run's timeline
        self.models = list(models)
        self.group = group
        self.version = version
        self.rollout = rollout if rank() == 0 else None
        self.timeout = timeout
        self._loop = HttpLoop()
        self.servers = ServerCalls(self.rollout, self._loop, timeout) if self.rollout is not None else None
        self.ctx = SyncContext(self.models, version, self.rollout, self.servers, self._loop, group, timeout,
                               flush_cache=interrupt != "in_place", events=self.events)
        self._targets: list[str] = []  # rank 0: the servers of the current (or last) push
        self.last: dict[str, float] = {}
        self.transport = transport
        try:
            transport.open(self.ctx)
        except BaseException:
            self._loop.close()
            raise
        self.verifier = Verifier(self.models, self.servers, group=group, method=verify_method, tol=verify_tol,
                                 temperature=temperature, logprobs=verify)

    @property
    def catches_up(self) -> bool:
        """The transport brings a server that came back behind up to date (`catch_up`, between steps)."""
        return self.transport.catches_up

    def _from_rank0(self, decide: Callable[[], Any]) -> Any:
        return self.ctx.decide(decide)

    # ---- the bracket -------------------------------------------------------------------------
    @contextlib.contextmanager
    def pause_bracket(self) -> Iterator[None]:
        """executor stops admitting -> client holds resubmits -> servers pause ... and back, in finally.

        How the servers pause is `rollout.interrupt`: abort (in-flight requests return their partial output and
        are resubmitted after the update), retract (the servers requeue them and prefill them again under the
        new weights), in_place (they keep their KV cache), none (no interruption: the bracket first waits for
        every in-flight request to finish, new ones held, then pauses)."""
        r = self.rollout
        if r is None:
            yield
            return
        self.events.emit("sync_start", phase="pause")
        with no_gc_pass():
            if r.executor is not None:
                r.executor.pause()
            try:
                r.client.pause()
                try:
                    try:
                        if self.interrupt == "none":  # the non-interruptible baseline: generation finishes first
                            self.servers.call(r.client.wait_idle(self.timeout), "waiting for the requests in flight")
                        elif self.interrupt == "abort":  # aborted and back before the pause, unparked: SGLang's
                            # abort pause then has no request handler to wait for (it polls them once a second)
                            try:
                                self.servers.call(r.client.abort_in_flight(min(self.timeout, ABORT_DRAIN_S)),
                                           "aborting the requests in flight")
                            except Exception as e:  # noqa: BLE001 - a shortcut only: the pause aborts them anyway
                                logger.warning("aborting the requests in flight ahead of the pause failed (%s: %s); "
                                               "the pause aborts them", type(e).__name__, e)
                        mode = "abort" if self.interrupt == "none" else self.interrupt
                        # the HTTP call carries the sync's timeout, so it cannot land after continue; the rollout
                        # loop sleeps meanwhile, so digesting the aborted answers does not slow the pause calls
                        with self._rollout_parked(r):
                            self.servers.call(r.client.pause_generation(mode=mode, timeout=self.timeout), "pause")
                        self.events.emit("sync_end", phase="pause")
                        yield
                    finally:  # also when pausing failed half-way: no server stays paused
                        self.events.emit("sync_start", phase="continue")
                        self.servers.continue_all()
                        self.events.emit("sync_end", phase="continue")
                finally:
                    r.client.resume()
            finally:
                if r.executor is not None:
                    r.executor.resume()
                    r.executor.wake()

    def _rollout_parked(self, r: RolloutSide) -> Any:
        """The executor's rollout loop asleep (a bare client has no loop of its own to park)."""
        return r.executor.parked(self.timeout + 10) if r.executor is not None else contextlib.nullcontext()

    def push(self) -> dict[str, float]:
        """New weights to every server, version += 1 (all trainer ranks call it). Raises SyncError.

        The servers are the client's `sync_targets`: a server that is down is left out (it is brought up to date
        when it answers again). A sync that fails because one of its servers went down meanwhile is done again
        without it, up to `PUSH_ATTEMPTS` times in all (a server may come back and crash again during a retry);
        any other failure is raised at once."""
        start = self.version.value
        first: Optional[SyncError] = None  # the failure that took the first server out: said with any later one
        with self.transport.pushing():
            for attempt in range(1, PUSH_ATTEMPTS + 1):
                try:
                    out = self._push_once(probe=attempt == 1)  # a retry does not wait on the server it just lost
                    break
                except SyncError as e:
                    if first is not None and str(first) not in str(e):
                        e = SyncError(f"{e} (after an earlier attempt: {first})")
                    first = first or e
                    if self.version.value != start or attempt == PUSH_ATTEMPTS:  # committed (a verify failed after
                        raise e                                                   # it), or out of attempts
                    lost = self._from_rank0(lambda: self.servers.lost(self._targets))
                    if not lost:
                        raise e
                    if self.servers is not None:
                        logger.warning("weight sync failed while server(s) %s went down or hung (%s); syncing again "
                                       "without them (attempt %d of %d)", ", ".join(lost), str(e)[:600], attempt + 1,
                                       PUSH_ATTEMPTS)
        self.transport.after_push()
        return out

    def _push_once(self, probe: bool = True) -> dict[str, float]:
        t0 = time.perf_counter()
        target = self.version.value + 1
        if self.servers is not None:
            self._targets = self.servers.targets(probe=probe)
        self.transport.members()
        with self.events.span("sync", phase="prepare", version=target):
            errors = agree(self._guarded(self.transport.prepare, target, "prepare"), self.group)  # disk: export
        rolled = None
        with contextlib.ExitStack() as stack:
            if not errors:  # the same on every rank: they agreed
                enter_error = None
                if self.rollout is not None:
                    try:
                        stack.enter_context(self.pause_bracket())
                    except Exception as e:  # noqa: BLE001 - e.g. a dead server: the bracket has undone itself
                        enter_error = f"pause: {type(e).__name__}: {e}"
                errors = agree(enter_error, self.group)
            if not errors:
                try:
                    errors = self._run_phases(target)
                except BaseException:  # Ctrl-C / SIGTERM mid-sync: drop what the servers got, then continue
                    self.transport.abort()
                    self.transport.rollback(self._targets)
                    self.transport.end_quietly()
                    raise
                if errors:
                    self.transport.abort()  # a receive still waiting on a broken group fails now, not at its timeout
                    rolled = self.transport.rollback(self._targets)  # inside the bracket: servers drop this sync
                    self.transport.end_quietly()  # no server is left with a weight-update session open
                elif self.rollout is not None:
                    self.version.set(target)
                    self.rollout.client.synced(target)  # servers are admitted at this version now
        if errors:
            self.transport.after_failure()
            agree(None, self.group)  # no rank leaves before rank 0 has rolled back and continued the servers
            raise SyncError(f"weight sync to version {target} failed ({'; '.join(errors)}); "
                            + (rolled or f"the servers keep version {self.version.value}"))
        self.version.set(from_rank0(self.version.value, self.group))  # every rank's copy follows rank 0's
        self.last = {**self.transport.figures, "sync/push_s": time.perf_counter() - t0}
        if self.verifier.enabled:
            t1 = time.perf_counter()
            self.verify()
            self.last["sync/verify_s"] = time.perf_counter() - t1
        return dict(self.last)

    def verify(self, expect_change: Optional[bool] = None) -> float:
        """The verifier's check of the last push's servers at the current version (every rank); its figures go into
        `last`. `expect_change`: the push sent weights that differ from the last (default: the transport's
        `sends_new_weights`). Returns the largest difference found (0 for the exact digest); raises SyncError."""
        change = self.transport.sends_new_weights if expect_change is None else expect_change
        figures = self.verifier.check(self.version.value, self._targets, expect_change=change,
                                      fp8_block=self.transport.fp8_block)
        self.last.update(figures)
        return figures["sync/verify_max_abs_diff"]

    def _run_phases(self, target: int, span_update: bool = True) -> list[str]:
        """The one phase chain of a push and of a catch-up, the transport's phases 2-5, every rank, each agreed
        across ranks (the first failure ends it): 2. begin: open the servers' weight-update sessions (SGLang
        0.5.21+); 3. update: send the weights; 4. commit: the version on the servers (distributed); 5. end: close
        the sessions (SGLang finalizes the load). Returns the agreed errors ([] when every phase succeeded)."""
        t = self.transport
        for phase, fn in (("begin_weight_update", t.begin), ("update", t.update), ("commit", t.commit),
                          ("end_weight_update", t.end)):
            span = self.events.span("sync", phase="update", version=target) if phase == "update" and span_update \
                else contextlib.nullcontext()
            with span:
                errors = agree(self._guarded(fn, target, phase), self.group)
            if errors:
                return errors
        return []

    @staticmethod
    def _guarded(fn: Callable[[int], Optional[str]], target: int, phase: str) -> Optional[str]:
        """fn's error (returned or raised) as '<phase>: <error>', or None."""
        try:
            error = fn(target)
        except Exception as e:  # noqa: BLE001 - becomes this rank's error in the agreement
            error = f"{type(e).__name__}: {e}"
        return f"{phase}: {error}" if error and not error.startswith(f"{phase}: ") else error

    # ---- catching up a server that came back behind --------------------------------------------
    def catch_up_due(self) -> bool:
        """Rank 0: a server waits for the trainer to bring it to the current weights (`catch_up`)."""
        return self.transport.catches_up and self.transport.waiting()

    def catch_up(self) -> None:
        """Every rank, between two steps: the servers that came back behind get the current version's weights over
        a weight path of their own (no pause: they generate nothing; the others go on), committed at the current
        version, then verified as a push is (`trainer.verify_sync`). A failure is logged, not raised: the server
        stays out and asks again when probed next. The next push builds the group over every server."""
        if not self.transport.catches_up:
            return
        due = self._from_rank0(self.transport.due)
        if not due:
            return
        v, t0, last = self.version.value, time.perf_counter(), self.last
        if self.servers is not None:
            logger.warning("bringing server(s) %s to weight version %d (back behind it)", ", ".join(due), v)
            self._targets = list(due)
        with self.events.span("sync", phase="catch_up", version=v):
            errors = self._send_current(due, v)
            if not errors and self.verifier.enabled:
                try:  # their weights equal the trainer's though unchanged since the last push; the other servers'
                    with self.verifier.keeping_checksums():  # checksums stay for the next push's check
                        self.verify(expect_change=False)
                except SyncError as e:
                    errors = [str(e)]
        self.last = last  # the step's own sync figures, not these
        if self.servers is not None:
            self.transport.settle(due)
            if errors:
                logger.warning("bringing server(s) %s to weight version %d failed (they stay out and ask again): %s",
                               ", ".join(due), v, "; ".join(errors)[:600])
            else:
                logger.info("server(s) %s now at weight version %d (%.2fs)", ", ".join(due), v,
                            time.perf_counter() - t0)

    def _send_current(self, due: list[str], v: int) -> list[str]:
        """Every rank: the weight path over `due`, then the phases at version `v`. Agreed errors."""
        try:
            self.transport.rebuild(due)
            errors = self._run_phases(v, span_update=False)
        except SyncError as e:
            errors = [str(e)]
        if errors:
            self.transport.abort()
            self.transport.end_quietly()
            self.transport.after_failure()
        return errors

    def close(self) -> None:
        try:
            self.transport.close()
        finally:
            self._loop.close()
