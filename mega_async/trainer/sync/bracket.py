"""Weight sync: the trainer's new weights onto the inference servers; the one owner of the weight version.

    push(): [disk: export HF dir] -> pause bracket { [distributed: resharder buckets -> POST + broadcast]
            [disk: servers load the dir] -> version += 1 } -> [verify: probe logprobs equal the trainer's]

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


class WeightSync:
    """Common part of both modes: the version, the pause bracket, the phase chain; it holds rank 0's `ServerCalls`
    (`servers`, None on the other ranks) and the `Verifier`. Subclasses (the transports) send the weights
    (`_update`) and may take part in the other phases through the hooks below."""

    sends_new_weights = True  # every push sends weights that differ from the last (a training step ran)
    catches_up = False  # the trainer brings a server that came back behind up to date (`catch_up`, between steps)

    def __init__(self, models: Sequence[torch.nn.Module], version: WeightVersion, rollout: Optional[RolloutSide],
                 *, timeout: float = 300.0, verify: Optional[Callable[[dict], torch.Tensor]] = None,
                 verify_tol: float = 1e-4, temperature: float = 1.0, group: Any = None, events: Any = None,
                 verify_method: str = "auto", interrupt: str = "abort"):
        self.events = events if events is not None else NullEventLog()  # phases on the run's timeline
        self.models = list(models)
        self.group = group  # for the small agreements between ranks (a gloo group with a long timeout)
        self.version = version
        self.rollout = rollout if rank() == 0 else None
        self.timeout = timeout
        if interrupt not in INTERRUPT_MODES:
            raise ValueError(f"interrupt={interrupt!r}: use one of {INTERRUPT_MODES}")
        self.interrupt = interrupt
        self.flush_cache = interrupt != "in_place"  # SGLang 0.5.21+ fails an update whose flush finds requests
        self.fp8_block: Optional[tuple[int, int]] = None  # FP8 block quantization on the way (disk, distributed)
        self._targets: list[str] = []  # rank 0: the servers of the current (or last) push
        self._loop = HttpLoop()
        self.servers = ServerCalls(self.rollout, self._loop, timeout) if self.rollout is not None else None
        self.verifier = Verifier(self.models, self.servers, group=group, method=verify_method, tol=verify_tol,
                                 temperature=temperature, logprobs=verify)
        self.last: dict[str, float] = {}

    def _from_rank0(self, decide: Callable[[], Any]) -> Any:
        """One decision: rank 0 makes it from the servers' answers (`decide()`), every rank gets it."""
        return from_rank0(decide() if self.servers is not None else None, self.group)

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
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            try:
                return self._push_once(probe=attempt == 1)  # a retry does not wait on the server it just lost
            except SyncError as e:
                if first is not None and str(first) not in str(e):
                    e = SyncError(f"{e} (after an earlier attempt: {first})")
                first = first or e
                if self.version.value != start or attempt == PUSH_ATTEMPTS:  # committed (a verify failed after
                    raise e                                                   # it), or out of attempts
                lost = self._from_rank0(lambda: self.servers.lost(self._targets))
                if not lost:
                    raise e
                if self.rollout is not None:
                    logger.warning("weight sync failed while server(s) %s went down or hung (%s); syncing again "
                                   "without them (attempt %d of %d)", ", ".join(lost), str(e)[:600], attempt + 1,
                                   PUSH_ATTEMPTS)
        raise AssertionError("unreachable")

    def _membership(self) -> None:
        """Before a push (every rank): the distributed sync rebuilds its group when the servers changed."""

    def _push_once(self, probe: bool = True) -> dict[str, float]:
        t0 = time.perf_counter()
        target = self.version.value + 1
        if self.servers is not None:
            self._targets = self.servers.targets(probe=probe)
        self._membership()
        with self.events.span("sync", phase="prepare", version=target):
            errors = agree(self._guarded(self._prepare, target, "prepare"), self.group)  # disk: export
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
                    self._abort()
                    self._rollback()
                    self._end_quietly()
                    raise
                if errors:
                    self._abort()  # a receive still waiting on a broken group fails now instead of at its timeout
                    rolled = self._rollback()  # still inside the bracket: servers drop this sync, then continue
                    self._end_quietly()  # no server is left with a weight-update session open
                elif self.rollout is not None:
                    self.version.set(target)
                    self.rollout.client.synced(target)  # servers are admitted at this version now
        if errors:
            self._after_failure()
            agree(None, self.group)  # no rank leaves before rank 0 has rolled back and continued the servers
            raise SyncError(f"weight sync to version {target} failed ({'; '.join(errors)}); "
                            + (rolled or f"the servers keep version {self.version.value}"))
        self.version.set(from_rank0(self.version.value, self.group))  # every rank's copy follows rank 0's
        self.last = {**self.last, "sync/push_s": time.perf_counter() - t0}
        if self.verifier.enabled:
            t1 = time.perf_counter()
            self.verify()
            self.last["sync/verify_s"] = time.perf_counter() - t1
        return dict(self.last)

    def verify(self, expect_change: Optional[bool] = None) -> float:
        """The verifier's check of the last push's servers at the current version (every rank); its figures go into
        `last`. `expect_change`: the push sent weights that differ from the last (default: `sends_new_weights`).
        Returns the largest difference found (0 for the exact digest); raises SyncError."""
        figures = self.verifier.check(self.version.value, self._targets,
                                      expect_change=self.sends_new_weights if expect_change is None else expect_change,
                                      fp8_block=self.fp8_block)
        self.last.update(figures)
        return figures["sync/verify_max_abs_diff"]

    def _run_phases(self, target: int, span_update: bool = True) -> list[str]:
        """The one phase chain of a push and of a catch-up, every rank, each phase agreed across ranks (the first
        failure ends it): 1. begin: open the servers' weight-update sessions (SGLang 0.5.21+); 2. update: send the
        weights; 3. commit: the version on the servers (distributed); 4. end: close the sessions (SGLang finalizes
        the load). Returns the agreed errors ([] when every phase succeeded everywhere)."""
        for phase, fn in (("begin_weight_update", self._begin), ("update", self._update), ("commit", self._commit),
                          ("end_weight_update", self._end)):
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

    def _commit(self, target: int) -> Optional[str]:
        """After every rank succeeded (distributed: the version is set on the servers only now)."""
        return None

    # ---- catching up a server that came back behind --------------------------------------------
    def catch_up_due(self) -> bool:
        """Rank 0: a server waits for the trainer to bring it to the current weights (`catch_up`)."""
        return False

    def catch_up(self) -> None:
        """Every rank, between two steps: the current version's weights to the servers that came back behind."""

    # ---- hooks -------------------------------------------------------------------------------
    def _prepare(self, target: int) -> None:
        """Work done before the pause (disk: write the checkpoint)."""

    def _update(self, target: int) -> Optional[str]:
        """Send the weights inside the bracket; returns this rank's error, or None."""
        raise NotImplementedError

    def _rollback(self) -> Optional[str]:
        """Rank 0 asks the servers to drop this sync; returns what went wrong (None: every server rolled back)."""
        return self.servers.rollback(self._targets) if self.servers is not None else None

    def _begin(self, target: int) -> Optional[str]:
        """Inside the bracket, before any weight moves (distributed: open the servers' weight-update sessions)."""
        return None

    def _end(self, target: int) -> Optional[str]:
        """After the commit (distributed: close the sessions; SGLang finalizes the load there)."""
        return None

    def _end_quietly(self) -> None:
        """On every failure path, after the rollback: close whatever session is still open; never raises."""

    def _abort(self) -> None:
        """Right after a failure, before the rollback (distributed: drop this rank's side of the group)."""

    def _after_failure(self) -> None:
        """Clean-up after a failed sync (distributed: the groups may be broken)."""

    def close(self) -> None:
        self._loop.close()
