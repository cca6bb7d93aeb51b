"""AsyncTaskRunner: an asyncio loop in a background thread that runs episodes concurrently.

Tasks wait in a FIFO until `admit()` lets them start; `pause()` stops new starts while running
tasks continue. An error in the runner's own machinery is kept and re-raised to callers.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from typing import Any, Awaitable, Callable, Iterator, Optional

logger = logging.getLogger("mega_async.rollout.runner")

# admit() returns a token (e.g. the admission version) or None when there is no room.
AdmitFn = Callable[[], Optional[Any]]
TaskFactory = Callable[[Any], Awaitable[Any]]
DoneFn = Callable[[int, Any, Optional[BaseException]], None]


class RunnerError(RuntimeError):
    """The runner's own thread failed; raised in the caller (fail fast, never a silent hang)."""


class AsyncTaskRunner:
    def __init__(self, admit: AdmitFn | None = None, name: str = "rollout",
                 on_admitted: Optional[Callable[[], None]] = None):
        self._admit: AdmitFn = admit or (lambda: True)
        self._on_admitted = on_admitted  # called on the loop thread, no lock held, after a round of admissions
        self._name = name
        self._pending: collections.deque[tuple[int, TaskFactory, DoneFn]] = collections.deque()
        self._pending_lock = threading.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._paused = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._loop_thread_id: Optional[int] = None
        self._loop_running = False  # cleared when the loop thread ends (cheaper than Thread.is_alive per call)
        self._wake_scheduled = False  # a cross-thread wake is queued: later ones coalesce into it
        self._started = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncTaskRunner already started")
        self._thread = threading.Thread(target=self._thread_main, name=f"{self._name}-runner", daemon=True)
        self._thread.start()
        self._started.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel running tasks, drop pending ones, and join the thread."""
        if self._thread is None or self._loop is None:
            return
        self._stopping = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._wake.set)  # type: ignore[union-attr]
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("runner thread did not stop within %.1fs", timeout)
        self._thread = None

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._loop_thread_id = threading.get_ident()
        self._loop_running = True
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main())
        except BaseException as e:  # noqa: BLE001 - surfaced to callers through check()
            logger.exception("rollout runner thread failed")
            self.error = e
        finally:
            for t in list(self._tasks):
                t.cancel()
            if self._tasks:
                loop.run_until_complete(asyncio.gather(*self._tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())  # e.g. the client's HTTP session on this loop
            loop.close()
            self._loop_running = False

    async def _main(self) -> None:
        self._wake = asyncio.Event()
        self._started.set()
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            self._wake_scheduled = False
            if self.error is not None:
                raise self.error
            if self._launch_admitted() and self._on_admitted is not None:
                self._on_admitted()

    def _launch_admitted(self) -> int:
        """Start every pending task that admit() lets in; returns how many started."""
        started = 0
        while not self._stopping:
            with self._pending_lock:  # pause() takes this lock: after it returns nothing is admitted
                if self._paused.is_set() or not self._pending:
                    return started
                token = self._admit()
                if token is None:
                    return started
                task_id, factory, on_done = self._pending.popleft()
            task = asyncio.get_running_loop().create_task(self._run(task_id, factory, token, on_done))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            started += 1
        return started

    async def _run(self, task_id: int, factory: TaskFactory, token: Any, on_done: DoneFn) -> None:
        result, exc = None, None
        try:
            result = await factory(token)
        except asyncio.CancelledError:
            if self._stopping:
                return
            exc = RuntimeError("episode cancelled")
        except Exception as e:  # noqa: BLE001 - an episode error is a rejection, reported by on_done
            exc = e
        try:
            on_done(task_id, result, exc)
        except BaseException as e:  # noqa: BLE001 - bookkeeping failed: the runner is broken
            logger.exception("on_done for task %d failed", task_id)
            self.error = e
        self.wake()

    # ---- API (any thread) ------------------------------------------------------------------
    def check(self) -> None:
        if self.error is not None:
            raise RunnerError(f"{self._name} runner failed: {self.error!r}") from self.error
        if self._thread is None or not self._loop_running:
            raise RunnerError(f"{self._name} runner is not running (call start() first)")

    def submit(self, task_id: int, factory: TaskFactory, on_done: DoneFn, wake: bool = True) -> None:
        """Queue a task; it starts once not paused and `admit()` returns a token (passed to factory).
        `wake=False` defers admission to the next wake() (one loop hand-off for a burst of submits)."""
        self.check()
        with self._pending_lock:
            self._pending.append((task_id, factory, on_done))
        if wake:
            self.wake()

    def start_admitted(self, task_id: int, factory: TaskFactory, token: Any, on_done: DoneFn) -> None:
        """Start a task that was admitted before (a rollout restored from a checkpoint): no admit(), no pause."""
        self.check()

        def create() -> None:
            task = asyncio.get_running_loop().create_task(self._run(task_id, factory, token, on_done))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._loop.call_soon_threadsafe(create)  # type: ignore[union-attr]

    def call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run `fn` on the runner's loop thread and return its result: atomic with respect to every episode."""
        import concurrent.futures

        self.check()
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                fut.set_exception(e)

        self._loop.call_soon_threadsafe(run)  # type: ignore[union-attr]
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            if fut.done():  # fn's own timeout, or it finished just as the wait ran out
                return fut.result()
            name = getattr(fn, "__qualname__", repr(fn))
            raise TimeoutError(f"the rollout loop did not run {name} within {timeout:g}s (the loop is busy or "
                               "stuck; py-spy dump shows where)") from None

    @contextlib.contextmanager
    def parked(self, limit: float) -> Iterator[None]:
        """The loop thread sleeps while the body runs (at most `limit` s), the GIL free for the caller: from its
        next turn the loop runs no task and reads no socket, and whatever arrives meanwhile waits in the kernel's
        buffers. No-op from the loop thread itself or when the loop is not running."""
        loop = self._loop
        if loop is None or not self._loop_running or threading.get_ident() == self._loop_thread_id:
            yield
            return
        release = threading.Event()
        try:
            loop.call_soon_threadsafe(release.wait, limit)
        except RuntimeError:  # the loop closed meanwhile
            yield
            return
        try:
            yield
        finally:
            release.set()

    def wake(self) -> None:
        """Re-evaluate admission (after a submit, a finished task, a version bump or resume)."""
        loop, ev = self._loop, self._wake
        if loop is None or ev is None:
            return
        if threading.get_ident() == self._loop_thread_id:  # on the loop (a finished task): no self-pipe write
            ev.set()
            return
        if self._wake_scheduled:  # a queued wake has not run yet: it will see this change too
            return
        if not loop.is_closed():
            self._wake_scheduled = True
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # loop closed between the check and the call
                pass

    def pause(self) -> None:
        """Stop admitting new tasks; once this returns, no new task starts until resume()."""
        with self._pending_lock:
            self._paused.set()

    def resume(self) -> None:
        self._paused.clear()
        self.wake()

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    @property
    def num_pending(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    @property
    def num_running(self) -> int:
        return len(self._tasks)
