"""What every part of the weight sync shares: the error, the HTTP loop thread and the rollout side the bracket
pauses (the agreement between trainer ranks is mega_async.utils.comm's).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from typing import Any, Optional, Sequence

import torch


logger = logging.getLogger("mega_async.trainer.sync")


INTERRUPT_MODES = ("abort", "retract", "in_place", "none")  # rollout.interrupt


class SyncError(RuntimeError):
    """A weight sync failed; the servers keep their old weights and version."""


# what a wait for the client's HTTP calls allows beyond their own timeout: those end first and name the server
# that did not answer; the wait's own timeout (PhaseTimeout) is the backstop for a call with none of its own
SLACK_S = 10.0


class PhaseTimeout(TimeoutError):
    """A phase of the sync (its HTTP calls, a broadcast) did not finish in time; the message names the phase."""


def future_result(fut: concurrent.futures.Future, timeout: Optional[float], what: str) -> Any:
    """`fut`'s result within `timeout` seconds, else PhaseTimeout naming `what` (the future is cancelled:
    nothing is left running on the HTTP thread). Its own exceptions, timeouts included, pass through as they
    are (concurrent.futures' own timeout has an empty message: `TimeoutError: `)."""
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError:
        if fut.done():  # its own timeout, or it finished just as the wait ran out
            return fut.result()
        fut.cancel()
        raise PhaseTimeout(f"{what}: not done within {timeout:g}s") from None


class HttpLoop:
    """A private event loop thread for the client's HTTP calls: the trainer gets futures, never asyncio.run."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sync-http", daemon=True)
        self._thread.start()

    def submit(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Any, timeout: Optional[float] = None, what: str = "an HTTP call of the weight sync") -> Any:
        """Run `coro` on the loop thread; PhaseTimeout naming `what` after `timeout` seconds (see `future_result`)."""
        return future_result(self.submit(coro), timeout, what)

    def close(self) -> None:
        if self._thread.is_alive():  # what lives on this loop (the client's HTTP session) is closed first
            with contextlib.suppress(Exception):
                self.run(self.loop.shutdown_asyncgens(), 5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


class RolloutSide:
    """What the DP head pauses and resumes: the executor (may be None) and the SGLang client."""

    def __init__(self, client: Any, executor: Any = None):
        self.client = client
        self.executor = executor


def fp8_block_of(models: Sequence[torch.nn.Module], weight_format: str) -> Optional[tuple[int, int]]:
    """trainer.sync_weight_format: None (the trainer's dtype) or the FP8 block of the servers' checkpoint."""
    from mega_async.bridge import bridge_for, fp8

    if weight_format == "model_dtype":
        return None
    return fp8.sync_block(weight_format, bridge_for(models).hf_config if models else None)
