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


class RewardRunner:
    """Await a reward with a timeout; sync functions run in a shared thread pool.

    A raising, timed-out or non-finite reward returns None (the sample is rejected) and is logged.
    A timed-out sync function cannot be killed: it finishes in its thread, its result discarded.
    """

    def __init__(self, fn: Callable[..., Any], timeout: float = 15.0):
        self.fn = fn
        self.timeout = timeout
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
        self.failures = 0

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
            self.failures += 1
            logger.warning("reward %s timed out after %.1fs; sample rejected", name, self.timeout)
            return None
        except Exception as e:  # noqa: BLE001 - a broken reward rejects the sample, loudly
            self.failures += 1
            logger.warning("reward %s raised %s: %s; sample rejected", name, type(e).__name__, e)
            return None
        if not math.isfinite(value):
            self.failures += 1
            logger.warning("reward %s returned %r; sample rejected", name, value)
            return None
        return value
