"""Reward functions `fn(prompt, completion, **item) -> float` (sync or async) and their runner."""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
import math
from typing import Any, Callable, Optional

logger = logging.getLogger("mega_async.reward")

_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="reward")
    return _POOL


class RewardUnavailable(RuntimeError):
    """A reward that cannot be computed here at all (the code sandbox cannot start on this machine, or the reward
    failed on every sample of a long row): the rollout stops at once rather than rejecting every sample forever."""


class RewardRunner:
    """Await a reward with a timeout; sync functions run in a shared thread pool.

    A raising, timed-out or non-finite reward returns None (the sample is rejected) and is logged.
    A timed-out sync function cannot be killed: it finishes in its thread, its result discarded.
    A reward that cannot work here (`RewardUnavailable`: the code sandbox cannot start) or that failed on
    `max_failures_in_row` samples in a row raises `RewardUnavailable`: the rollout stops with that line instead
    of rejecting every sample of a run that would then never fill a batch.
    """

    max_failures_in_row = 64

    def __init__(self, fn: Callable[..., Any], timeout: float = 15.0):
        self.fn = fn
        self.timeout = timeout
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
        self.failures = 0
        self.failures_in_row = 0

    def _failed(self, name: str, why: str) -> None:
        self.failures += 1
        self.failures_in_row += 1
        logger.warning("reward %s %s; sample rejected", name, why)
        if self.failures_in_row >= self.max_failures_in_row:
            raise RewardUnavailable(f"reward {name} failed on {self.failures_in_row} samples in a row (last: {why}): "
                                    "fix the reward function or what it needs")

    async def __call__(self, prompt: str, completion: str, **item: Any) -> Optional[float]:
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        try:
            async with asyncio.timeout(self.timeout):  # no task per call, unlike wait_for
                if self.is_async:
                    value = await self.fn(prompt, completion, **item)
                else:
                    call = functools.partial(self.fn, prompt, completion, **item)
                    value = await asyncio.get_running_loop().run_in_executor(_pool(), call)
            value = float(value)
        except asyncio.TimeoutError:
            self._failed(name, f"timed out after {self.timeout:.1f}s")
            return None
        except RewardUnavailable:
            raise  # the machine cannot compute it at all: the rollout stops with its line
        except Exception as e:  # noqa: BLE001 - a broken reward rejects the sample, loudly
            self._failed(name, f"raised {type(e).__name__}: {e}")
            return None
        if not math.isfinite(value):
            self._failed(name, f"returned {value!r}")
            return None
        self.failures_in_row = 0
        return value
