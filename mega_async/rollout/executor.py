"""WorkflowExecutor: producer/consumer over the AsyncTaskRunner, gated by the StalenessManager.

submit(item) -> [pending, capped at (eta+1)*B] -> admitted when capacity > 0 (head version
recorded) -> workflow.arun_episode -> accepted | rejected -> wait()/prepare_batch() hand out
accepted results oldest head version first.

Failures: an episode that raises counts as failed and its item is not retried. After
`max_consecutive_failures` failed episodes in a row, or at once on a `FatalEngineError` (bad API key,
request over the context length, no usable server), the executor stops admitting and every wait()/
prepare_batch() raises `RolloutError` with the first error, instead of resubmitting without end.

Checkpoints: every episode runs against a `JournaledEngine`, so `snapshot()` (taken while paused) holds
every item waiting, running (with its generation so far: tokens, logprobs, versions) or finished but not
yet consumed; `restore()` puts them back with their head versions, and a running one continues from its
last token. With a `Ledger`, every finished episode gets a line (accepted ones when consumed).

Ordering guarantee: a batch is only handed out when no still-running episode has an older head
version than any result in it. Together with the capacity rule this bounds staleness strictly:
a result consumed at version s has head version >= s - eta.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Any, Callable, ContextManager, Iterable, Iterator, Optional

from mega_async.utils.events import NullEventLog
from mega_async.reward import RewardUnavailable
from mega_async.rollout.book import DONE, RUNNING, WAITING, Episode, EpisodeBook
from mega_async.rollout.dataloader import Sample
from mega_async.rollout.journal import EpisodeJournal, JournaledEngine
from mega_async.rollout.ledger import Ledger
from mega_async.rollout.runner import AsyncTaskRunner, RunnerError
from mega_async.rollout.staleness import StalenessManager
from mega_async.rollout.workflow import RolloutWorkflow
from mega_async.api.types import FatalEngineError, Version

logger = logging.getLogger("mega_async.rollout.executor")

AcceptFn = Callable[[dict], bool]


class ExecutorQueueFull(RuntimeError):
    """More items submitted than the pending-input cap (eta+1)*B allows."""


class RolloutError(RuntimeError):
    """Rollout stopped: an error retrying cannot fix, or too many failed episodes in a row."""


class WaitInterrupted(Exception):
    """prepare_batch() or fill() returned early because its `interrupt()` said so; nothing was taken."""


class WorkflowExecutor:
    def __init__(
        self,
        engine: Any,
        workflow: RolloutWorkflow | None = None,
        *,
        consumer_batch_size: int,
        max_staleness: int,
        max_concurrent_rollouts: int | None = None,
        should_accept: AcceptFn | None = None,
        poll_interval: float = 0.5,
        version: Version | None = None,
        max_consecutive_failures: int | None = 32,
        ledger: Ledger | None = None,
        events: Any = None,
    ):
        self.events = events if events is not None else NullEventLog()  # the run's timeline (mega_async.utils.events)
        self.engine = engine
        self.workflow = workflow
        self.should_accept = should_accept
        self.consumer_batch_size = consumer_batch_size
        self.max_staleness = max_staleness
        self.staleness = StalenessManager(
            max_concurrent_rollouts or consumer_batch_size * (max_staleness + 1), consumer_batch_size, max_staleness,
            version=version,
        )
        self.max_pending = (max_staleness + 1) * consumer_batch_size
        self._poll = poll_interval  # liveness only (a dead runner thread); every state change notifies
        self._runner = AsyncTaskRunner(admit=self.staleness.try_submit, name="rollout", on_admitted=self._on_admitted)
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._book = EpisodeBook()  # every episode not yet consumed: waiting, running or done (under _cond)
        self._counts = {"accepted": 0, "rejected": 0, "failed": 0, "filtered": 0, "consumed": 0, "output_tokens": 0}
        self._consumed_staleness: collections.Counter[int] = collections.Counter()  # version at consumption - head
        # the consumer sleeps until its batch may be ready, the rollout went idle, or the pending queue fell to
        # the refill mark: one hand-off per batch or refill, not one per finished episode
        self._want = 0  # results the blocked consumer waits for (0: nobody waits)
        self._want_refill = False  # the blocked consumer is prepare_batch(), which also refills the queue
        self._refill_mark = self.max_pending - max(1, self.max_pending // 4)
        self._data_iters: dict[int, tuple[Any, Iterator]] = {}
        self.max_consecutive_failures = max_consecutive_failures
        self._failures_in_row = 0
        self._first_failure: Optional[str] = None  # of the current run of failures
        self._fatal: Optional[RolloutError] = None
        self.ledger = ledger
        self.batches_out = 0  # batches handed out (= the consuming training step)

    @classmethod
    def from_config(cls, rollout_cfg: Any, engine: Any, workflow: RolloutWorkflow | None = None,
                    should_accept: AcceptFn | None = None, version: Version | None = None,
                    ledger: Ledger | None = None, events: Any = None) -> "WorkflowExecutor":
        return cls(
            engine,
            workflow,
            consumer_batch_size=rollout_cfg.consumer_batch_size,
            max_staleness=getattr(rollout_cfg, "staleness_budget", rollout_cfg.max_staleness),
            max_concurrent_rollouts=rollout_cfg.max_concurrent_rollouts,
            should_accept=should_accept,
            version=version,
            max_consecutive_failures=rollout_cfg.max_consecutive_failures,
            ledger=ledger,
            events=events,
        )

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> "WorkflowExecutor":
        self._runner.start()
        return self

    def stop(self) -> None:
        self._runner.stop()

    def __enter__(self) -> "WorkflowExecutor":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- producer --------------------------------------------------------------------------
    def submit(self, data: Any, workflow: RolloutWorkflow | None = None, *, tag: Optional[dict] = None,
               journal: Optional[EpisodeJournal] = None, head: Optional[int] = None, wake: bool = True) -> int:
        """Queue one item (one prompt group) for an episode; returns its task id. `tag` names the item in the
        ledger; `journal` and `head` restore an episode that was running at a checkpoint (it starts at once).
        `wake=False` leaves admission to the next wake() (one hand-off to the runner for a burst of submits)."""
        if self._fatal is not None:
            raise self._fatal
        wf = workflow or self.workflow
        if wf is None:
            raise ValueError("no workflow: pass one to submit() or to WorkflowExecutor(...)")
        pending = self.staleness.enqueued
        if head is None and pending >= self.max_pending:
            raise ExecutorQueueFull(
                f"{pending} items already wait for admission (cap (max_staleness+1)*B = {self.max_pending}); "
                "consume results with wait()/prepare_batch() before submitting more"
            )
        tid = next(self._ids)
        task = Episode(data, tag, wf, journal or EpisodeJournal())
        with self._cond:
            self._book.add(tid, task)
        self.staleness.on_enqueued()

        async def episode(head_version: int) -> Any:
            with self._cond:
                if not self._book.is_running(tid):  # a restored episode is registered at submit
                    self._book.start(tid, head_version)
            self.events.emit("episode_admitted", task=tid, head=head_version)
            return await wf.arun_episode(JournaledEngine(self.engine, task.journal), data)

        def on_done(task_id: int, result: Any, exc: Optional[BaseException]) -> None:
            self._on_done(task_id, data, result, exc)

        try:
            if head is None:
                self._runner.submit(tid, episode, on_done, wake=wake)
            else:
                self.staleness.on_submitted()  # admitted before the checkpoint: counted as running again
                with self._cond:  # running from now on: no batch may overtake its (older) head version
                    self._book.start(tid, head)
                self._runner.start_admitted(tid, episode, head, on_done)
        except RunnerError:
            if head is None:
                self.staleness.on_submitted()
            self.staleness.on_rejected()
            with self._cond:
                self._book.drop(tid)
            raise
        return tid

    def _on_done(self, tid: int, data: Any, result: Any, exc: Optional[BaseException]) -> None:
        with self._cond:
            task = self._book.get(tid)
            head = task.head
            verdict = "accepted"
            if exc is not None:
                verdict = "failed"
                logger.warning("episode %d rejected: %s: %s (item: %.200r)", tid, type(exc).__name__, exc, data)
            elif result is None:
                verdict = "rejected"
            elif self.should_accept is not None:
                try:
                    if not self.should_accept(result):
                        verdict = "filtered"
                except Exception as e:  # noqa: BLE001 - a broken filter rejects the sample, loudly
                    verdict = "failed"
                    logger.warning("should_accept raised %r on episode %d (item: %.200r)", e, tid, data)
            self._counts[verdict] += 1
            self.events.emit("episode_finished", task=tid, head=head, verdict=verdict)
            self._counts["output_tokens"] += task.journal.generated_tokens
            self._track_failures(verdict, exc)
            if verdict == "accepted":
                self.staleness.on_accepted()
                self._book.finish(tid, result)
            else:
                self.staleness.on_rejected()
                self._book.drop(tid)
                if self.ledger is not None:
                    self.ledger.write(task.tag, verdict, head, result if isinstance(result, dict) else None,
                                      error=f"{type(exc).__name__}: {exc}" if exc is not None else None)
            if self._want and (self._fatal is not None or not self._book.any_running or self._book.ready(self._want)
                               or (self._want_refill and self.staleness.enqueued <= self._refill_mark)):
                self._cond.notify_all()

    def _on_admitted(self) -> None:
        """Runner thread, after a round of admissions: a waiting consumer refills once the queue ran low."""
        if self._want_refill and self.staleness.enqueued <= self._refill_mark:
            with self._cond:
                self._cond.notify_all()

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _track_failures(self, verdict: str, exc: Optional[BaseException]) -> None:
        """Caller holds the lock. Stop the rollout on a fatal error or too many failures in a row."""
        if verdict != "failed":
            self._failures_in_row, self._first_failure = 0, None
            return
        self._failures_in_row += 1
        what = f"{type(exc).__name__}: {exc}" if exc is not None else "should_accept raised"
        self._first_failure = self._first_failure or what
        if self._fatal is not None:
            return
        if isinstance(exc, (FatalEngineError, RewardUnavailable)):
            self._fatal = RolloutError(f"rollout stopped: {what}")
        elif self.max_consecutive_failures and self._failures_in_row >= self.max_consecutive_failures:
            self._fatal = RolloutError(
                f"rollout stopped: {self._failures_in_row} episodes failed in a row "
                f"(rollout.max_consecutive_failures={self.max_consecutive_failures}); first error: {self._first_failure}")
        if self._fatal is not None:
            logger.error("%s", self._fatal)
            self._runner.pause()  # nothing new starts; wait()/prepare_batch() raise

    # ---- consumer --------------------------------------------------------------------------
    def _take(self, count: int) -> list[dict]:
        """Caller holds the lock: the `count` oldest results out of the book (`ready(count)` said they may go)."""
        out = []
        now = self.staleness.version
        for _, ep in self._book.take(count):
            self._consumed_staleness[now - ep.head] += 1
            if self.ledger is not None:
                self.ledger.write(ep.tag, "accepted", ep.head, ep.result, step=self.batches_out)
            out.append(ep.result)
        self._counts["consumed"] += count
        self.batches_out += 1
        return out

    def _check_alive(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        self._runner.check()

    def wait(self, count: int, timeout: float | None = None) -> list[dict]:
        """Block until `count` accepted results are ready; return them oldest head version first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            try:
                return self._wait_locked(count, timeout, deadline)
            finally:
                self._want = 0

    def _wait_locked(self, count: int, timeout: float | None, deadline: float | None) -> list[dict]:
        while True:
            self._check_alive()
            if self._book.ready(count):
                return self._take(count)
            self._raise_if_stuck(count)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(
                    f"wait({count}) timed out after {timeout}s with {self._book.done} results ready "
                    f"and {self._book.running} running"
                )
            self._want = count
            self._cond.wait(self._poll if remaining is None else min(self._poll, remaining))

    def _raise_if_stuck(self, count: int) -> None:
        """Nothing running and nothing can start: waiting would hang forever, so say why instead."""
        if self._book.any_running or self._book.done >= count or self._runner.num_running:
            return
        if self._runner.paused:
            raise RuntimeError(
                f"executor is paused with {self._book.done} of {count} results ready and nothing running; "
                "call resume() before waiting"
            )
        st = self.staleness.stats
        if st["enqueued"] and st["capacity"] <= 0 and st["running"] == 0:
            raise RuntimeError(
                f"staleness budget exhausted at version {st['version']} ({st['accepted']} accepted, "
                f"max_staleness={self.max_staleness}): call set_version() after each training step"
            )

    def prepare_batch(self, dataloader: Iterable, workflow: RolloutWorkflow | None = None,
                      interrupt: Optional[Callable[[], bool]] = None) -> list[dict]:
        """Keep up to (eta+1)*B items submitted ahead and return B accepted groups, oldest first.

        A re-iterable dataloader is restarted when exhausted (a new epoch); a one-shot iterator that
        runs dry with too few results raises instead of hanging. `interrupt()` true while it waits (checked every
        poll interval): `WaitInterrupted`, nothing taken (the trainer has to bring a server up to date first).
        """
        B = self.consumer_batch_size

        def batch(idle: bool) -> Optional[list[dict]]:
            return self._take(B) if self._book.ready(B) else None

        return self._generate_until(dataloader, workflow, interrupt, batch, lambda idle: self._raise_if_stuck(B),
                                    want=lambda: B, short=f", a batch needs {B}")

    def fill(self, dataloader: Iterable, workflow: RolloutWorkflow | None = None,
             interrupt: Optional[Callable[[], bool]] = None) -> None:
        """Generate until this version's staleness budget is spent and nothing runs (a stale-batch FIFO's
        producer step, rollout.stale_batches): every accepted group it leaves has this version as its head, or an
        older one, and no episode overlaps the training step that follows. Returns at once when already full."""

        def full(idle: bool) -> Optional[bool]:
            return True if idle and self.staleness.get_capacity() <= 0 else None

        def stuck(idle: bool) -> None:
            if self._runner.paused and idle:
                raise RuntimeError("executor is paused with nothing running; call resume() before fill()")

        self._generate_until(dataloader, workflow, interrupt, full, stuck,
                             want=lambda: max(1, self._book.done + 1),  # woken when everything ended
                             short=f" while filling version {self.version}'s budget")

    def _generate_until(self, dataloader: Iterable, workflow: RolloutWorkflow | None,
                        interrupt: Optional[Callable[[], bool]], outcome: Callable[[bool], Any],
                        stuck: Callable[[bool], None], want: Callable[[], int], short: str) -> Any:
        """The one wait loop of `prepare_batch` and `fill`: keep the pending queue full, then under the lock return
        `outcome(idle)` once it is not None (`idle`: nothing admitted runs); a one-shot dataloader that ran dry with
        nothing left to run raises (`short` says what was missing), `stuck(idle)` raises when waiting would hang,
        and `interrupt()` true raises `WaitInterrupted` (nothing taken). Otherwise it sleeps until an episode's end
        may have changed the answer (`want()` results wanted) or the pending queue fell to its refill mark."""
        while True:
            exhausted = self._refill(dataloader, workflow)
            with self._cond:
                self._check_alive()
                # the staleness manager counts an admission before its episode reaches the book
                idle = (not self._book.any_running and self.staleness.stats["running"] == 0
                        and self._runner.num_running == 0)
                out = outcome(idle)
                if out is not None:
                    return out
                if exhausted and idle and self._runner.num_pending == 0:
                    raise RuntimeError(f"dataloader exhausted: {self._book.done} accepted results{short}")
                stuck(idle)
                if interrupt is not None and interrupt():
                    raise WaitInterrupted()
                self._want, self._want_refill = want(), True
                try:
                    self._cond.wait(self._poll)
                finally:
                    self._want, self._want_refill = 0, False

    def _refill(self, dataloader: Iterable, workflow: RolloutWorkflow | None) -> bool:
        """Submit items until the pending cap is reached (one wake for all); True when a one-shot iterator ran dry."""
        try:
            return self._refill_quiet(dataloader, workflow)
        finally:
            self._runner.wake()

    def _refill_quiet(self, dataloader: Iterable, workflow: RolloutWorkflow | None) -> bool:
        key = id(dataloader)
        if key not in self._data_iters or self._data_iters[key][0] is not dataloader:
            self._data_iters[key] = (dataloader, iter(dataloader))
        while self.staleness.enqueued < self.max_pending:
            it = self._data_iters[key][1]
            try:
                item = next(it)
            except StopIteration:
                if iter(dataloader) is dataloader:  # one-shot iterator: no new epoch possible
                    return True
                self._data_iters[key] = (dataloader, iter(dataloader))
                try:
                    item = next(self._data_iters[key][1])
                except StopIteration:
                    return True  # empty dataloader
            if isinstance(item, Sample):
                self.submit(item.data, workflow, tag=item.tag, wake=False)
            else:
                self.submit(item, workflow, wake=False)
        return False

    # ---- checkpoint -------------------------------------------------------------------------
    def snapshot(self, timeout: float = 60.0) -> dict[str, Any]:
        """Every item not yet consumed (waiting, running with its journal, or finished) and the counters.
        Take it while paused (executor, client and servers): nothing then moves, and it runs on the runner's
        loop, so no episode changes state half-way through it."""

        def take() -> dict[str, Any]:
            with self._cond:
                eps = [{"tag": ep.tag, "data": ep.data, "head": ep.head if ep.state != WAITING else None,
                        "state": ep.state, "journal": ep.journal.snapshot() if ep.state == RUNNING else [],
                        "result": ep.result if ep.state == DONE else None} for _, ep in self._book]
                return {"episodes": eps, "counts": dict(self._counts), "batches_out": self.batches_out,
                        "staleness": self.staleness.stats, "accept": self._accept_state()}

        return self._runner.call(take, timeout)

    def _accept_state(self) -> Optional[dict]:
        """`should_accept`'s own state when it keeps one (the dynamic filter's counters and drop run)."""
        fn = getattr(self.should_accept, "state_dict", None)
        return fn() if callable(fn) else None

    def restore(self, state: dict[str, Any], workflow: RolloutWorkflow | None = None) -> None:
        """Put a snapshot back (after `on_version_recovered`): finished results ready to consume, running
        episodes continued from their journals under their old head versions, waiting items queued."""
        wf = workflow or self.workflow
        eps = state["episodes"]
        with self._cond:
            self._counts.update(state["counts"])
            self.batches_out = int(state["batches_out"])
            if state.get("accept") is not None and hasattr(self.should_accept, "load_state_dict"):
                self.should_accept.load_state_dict(state["accept"])  # e.g. the dynamic filter's counters
            for e in (e for e in eps if e["state"] == DONE):
                self._book.add(next(self._ids), Episode(e["data"], e["tag"], wf, head=e["head"], state=DONE,
                                                        result=e["result"]))
                self.staleness.on_enqueued()  # the capacity rule counts it as accepted again
                self.staleness.on_submitted()
                self.staleness.on_accepted()
        for e in (e for e in eps if e["state"] == "running"):
            self.submit(e["data"], wf, tag=e["tag"], journal=EpisodeJournal.restore(e["journal"]), head=e["head"])
        for e in (e for e in eps if e["state"] == "waiting"):
            self.submit(e["data"], wf, tag=e["tag"])

    # ---- control ---------------------------------------------------------------------------
    def pause(self) -> None:
        """Stop starting new episodes (running ones continue); call before a weight update."""
        self._runner.pause()
        self._notify()  # a consumer waiting with nothing running now has its answer

    def resume(self) -> None:
        if self._fatal is None:  # a stopped rollout stays stopped
            self._runner.resume()

    def parked(self, limit: float) -> ContextManager[None]:
        """Context manager: the rollout loop sleeps while the body runs (at most `limit` s). The weight sync's
        pause fan-out runs under it: the aborted requests' answers that arrive meanwhile are read once it ends,
        instead of taking the interpreter from the pause calls (at 7,440 aborts over 256 servers they did, for
        ~1 s of CPU). Nothing is lost: the answers wait in the sockets, and no episode is admitted while paused."""
        return self._runner.parked(limit)

    def set_version(self, v: int) -> None:
        self.staleness.set_version(v)
        self._runner.wake()

    def wake(self) -> None:
        """Re-check admission now (after the shared version was bumped by its owner)."""
        self._runner.wake()

    def on_version_recovered(self, v: int) -> None:
        self.staleness.on_version_recovered(v)
        self._runner.wake()

    @property
    def version(self) -> int:
        return self.staleness.version

    @property
    def paused(self) -> bool:
        return self._runner.paused

    @property
    def stats(self) -> dict[str, int]:
        """Staleness manager and verdict counters, generated tokens, and `consumed_staleness_<k>`: consumed
        groups by realized staleness (version at consumption minus head version)."""
        with self._cond:
            return {**self.staleness.stats, **self._counts, "ready": self._book.done,
                    **{f"consumed_staleness_{k}": n for k, n in sorted(self._consumed_staleness.items())}}
