"""GSM8K reward: 1.0 when the completion's final answer equals the number after `####`.

math-verify runs in killable worker processes (`isolated.WorkerPool`), not in the caller's thread: a
completion such as `The answer is 9^9^9^9` makes its sympy compute without end inside one C call that
holds the GIL, which froze the whole trainer (no thread or asyncio timeout can stop that). In the worker,
math-verify's own SIGALRM timeouts are on (a worker runs it in its main thread) and end most such inputs;
a call that still runs after `TIMEOUT` seconds has its worker killed. Either way the completion scores 0.0.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import threading

from mega_async.reward.isolated import WorkerPool, WorkerTimeout

if importlib.util.find_spec("math_verify") is None:  # imported only in the workers: fail here, not per sample
    raise ImportError("the GSM8K reward needs math-verify: pip install 'math-verify>=0.8'")

logger = logging.getLogger("mega_async.reward.gsm8k")

TIMEOUT = 5.0  # seconds a call may run in its worker before the worker is killed (the completion scores 0.0)
PARSE_TIMEOUT = VERIFY_TIMEOUT = 2  # math-verify's own limits in the worker (whole seconds, SIGALRM)
_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()


def gold_answer(answer: str) -> str:
    """The reference number of a GSM8K `answer` field (text after the last `####`)."""
    if "####" not in answer:
        raise ValueError("GSM8K answer has no '#### <number>' line")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def _pool() -> WorkerPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = WorkerPool(f"{__name__}:score", timeout=TIMEOUT, max_workers=min(8, os.cpu_count() or 1))
        return _POOL


def score(gold: str, completion: str) -> float:
    """math-verify's verdict on `completion` against the number `gold`, in this process (the workers' call)."""
    from math_verify import parse, verify

    for name in ("math_verify.parser", "math_verify.grader", "math_verify.utils"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # timeouts and parse failures are verdicts here
    try:
        gold_parsed = parse(gold, parsing_timeout=PARSE_TIMEOUT)
        pred = parse(completion, parsing_timeout=PARSE_TIMEOUT)
        if not gold_parsed or not pred:
            return 0.0
        return 1.0 if verify(gold_parsed, pred, timeout_seconds=VERIFY_TIMEOUT) else 0.0
    except MemoryError:  # over the worker's address-space limit: the input's fault, a wrong answer
        return 0.0


def gsm8k_reward(prompt: str, completion: str, answer: str, **_: object) -> float:
    gold = gold_answer(answer)
    try:
        return float(_pool().call(gold, completion))
    except WorkerTimeout as e:
        logger.warning("gsm8k reward: math-verify gave no verdict within %.0fs (%s); worker killed, scored 0.0",
                       TIMEOUT, e)
        return 0.0
