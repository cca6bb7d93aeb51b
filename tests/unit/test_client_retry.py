"""The client's retry rule for one /generate attempt (mega_async.inference.client.retry_step), as a table: every
outcome, below and past the bounds, through the router and straight to a server."""
import asyncio
import errno

import aiohttp
import pytest

from mega_async.inference.client import ServerHung, Step, outcome, retry_step
from mega_async.inference.client.transport import BUSY_WAIT_MAX_S

B = 0.2  # backoff
KW = dict(max_retries=3, backoff=B, request_timeout=60.0)

TABLE = [
    # (kind, arguments, expected step)
    ("ok", dict(attempt=0), Step("return")),
    ("refused", dict(attempt=2), Step("raise")),
    ("emfile", dict(attempt=3), Step("wait", B * 3)),
    ("emfile", dict(attempt=30), Step("wait", B * 10)),  # the wait is bounded
    ("broken", dict(attempt=1), Step("resend")),  # a kept-alive connection the server closed: once, at once
    ("broken", dict(attempt=2, resent=True), Step("out", B * 2, unstick=True)),
    ("no_answer", dict(attempt=1), Step("out", B * 1, unstick=True)),
    ("no_answer", dict(attempt=1, router=True), Step("out", B * 1, unstick=True)),
    # busy: backpressure, waited for (Retry-After, else a growing backoff, both bounded), never a failure
    ("busy", dict(attempt=1, count=1), Step("wait", B * 2, unstick=True)),
    ("busy", dict(attempt=2, count=2, retry_after=5.0), Step("wait", 5.0, unstick=True)),
    ("busy", dict(attempt=2, count=2, retry_after=0.0), Step("wait", B, unstick=True)),
    ("busy", dict(attempt=2, count=2, retry_after=1e6), Step("wait", BUSY_WAIT_MAX_S, unstick=True)),
    ("busy", dict(attempt=9, count=2, busy_for=61.0), Step("raise")),
    ("busy", dict(attempt=4, count=4), Step("ask")),  # past max_retries: is it down as a whole?
    ("busy", dict(attempt=4, count=4, whole=True), Step("take_out", unstick=True)),
    ("busy", dict(attempt=4, count=4, whole=False), Step("wait", B * 16, unstick=True)),
    ("busy", dict(attempt=4, count=4, router=True), Step("wait", B * 16, unstick=True)),  # a router: waited for ...
    ("busy", dict(attempt=9, count=9, router=True, busy_for=11.0), Step("router_down", unstick=True)),  # ... a bound
    ("busy", dict(attempt=9, count=9, router=True, busy_for=11.0, router_busy=20.0), Step("wait", B * 32, unstick=True)),
    # 5xx: counted in a row per server; past max_retries out (down as a whole) or dropped (a wedged engine)
    ("failed", dict(attempt=1, count=1), Step("wait", B * 2)),
    ("failed", dict(attempt=3, count=3), Step("wait", B * 8)),
    ("failed", dict(attempt=4, count=4), Step("ask")),
    ("failed", dict(attempt=4, count=4, whole=True), Step("take_out", unstick=True)),
    ("failed", dict(attempt=4, count=4, whole=False), Step("wedged", unstick=True)),  # out until /generate answers
    ("failed", dict(attempt=4, count=4, router=True), Step("router_down", unstick=True)),
]


@pytest.mark.parametrize("kind,args,expected", TABLE, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(TABLE)])
def test_retry_step_table(kind, args, expected):
    assert retry_step(kind, **args, **KW) == expected


def test_unknown_outcome_is_refused():
    with pytest.raises(ValueError, match="unknown outcome"):
        retry_step("teapot", attempt=1, **KW)


def test_outcome_of_answers_and_errors():
    assert [outcome(None, s) for s in (200, 400, 401, 429, 503, 500, 502)] == \
        ["ok", "refused", "refused", "busy", "busy", "failed", "failed"]
    assert outcome(aiohttp.ServerDisconnectedError(), 0) == "broken"
    assert outcome(asyncio.TimeoutError(), 0) == "no_answer"
    assert outcome(ServerHung("cut"), 0) == "no_answer"
    assert outcome(OSError(errno.EMFILE, "Too many open files"), 0) == "emfile"
