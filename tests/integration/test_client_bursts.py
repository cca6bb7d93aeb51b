"""Failures that pass: a burst of 5xx from one server while many requests are in flight counts once per wave of
requests, not once per request, and a server taken out for it comes back once it generates again; a router that
answers busy (smg's `503 No available workers`) for longer than a bound is gone around, naming it, instead of being
waited on until the run dies. A proxy in front of an in-process embedded server spoils the answers."""
import asyncio
import logging
import time

import aiohttp
import pytest
from aiohttp import web

from mega_async.api.types import ModelRequest
from mega_async.inference.client import SGLangClient
from tests.unit.thread_server import ThreadServer
from .server_inproc import InProcessServer

PROMPT = [5, 17, 300, 42, 7, 99]


@pytest.fixture(scope="module")
def backend(weights_root):
    s = InProcessServer(str(weights_root / "v0"), weights_root=str(weights_root))
    try:
        yield s
    finally:
        s.close()


def proxy(target: str, spoil) -> ThreadServer:
    """Forwards every call to `target`, except a /generate for which `spoil()` returns a response."""
    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == "/generate" and (bad := spoil()) is not None:
            await request.read()
            return bad
        async with aiohttp.ClientSession() as s:
            async with s.request(request.method, f"http://{target}{request.path_qs}", data=await request.read(),
                                 headers={"Content-Type": request.content_type}) as r:
                return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return ThreadServer(app)


def generate(client: SGLangClient, n: int) -> list:
    async def go():
        try:
            return await asyncio.gather(*(client.agenerate(ModelRequest(input_ids=PROMPT, max_new_tokens=4))
                                          for _ in range(n)))
        finally:
            await client.aclose()
    return asyncio.run(go())


def test_a_burst_of_500s_does_not_drop_the_only_server(backend):
    """64 requests in flight fail together for 1.5 s (before: 64 failures "in a row", the server dropped for good
    as a wedged engine since its /model_info answered, and the run ended with NoHealthyServerError)."""
    until = time.monotonic() + 1.5

    def spoil():
        if time.monotonic() < until:
            return web.json_response({"error": {"message": "transient"}}, status=500)
        return None

    front = proxy(backend.address, spoil)
    try:
        client = SGLangClient([front.address])  # the defaults users run with
        got = generate(client, 64)
        assert [len(r.output_tokens) for r in got] == [4] * 64
        s = client.servers[0]
        assert s.dropped is None and s.healthy and not s.wedged
    finally:
        front.close()


def test_a_router_busy_past_the_bound_is_gone_around(backend, caplog):
    """smg answers 503 while it trusts no worker: generation goes straight to the healthy server behind it after
    `router_busy` seconds, and the line names the router (before: waited until request_timeout, then the run died
    advising to raise the server's queue bound)."""
    busy = lambda: web.json_response({"error": {"message": "No available workers"}}, status=503)  # noqa: E731
    router = proxy(backend.address, busy)
    try:
        client = SGLangClient([backend.address], router=router.address)  # the defaults: router_busy 10 s
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="mega_async.inference.client"):
            got = generate(client, 8)
        assert [len(r.output_tokens) for r in got] == [4] * 8
        assert time.monotonic() - t0 < 30  # not request_timeout (300 s)
        assert client.router_stats() == {"answers": 0, "around": 8}
        assert any(f"router http://{router.address} failed (/generate answered 503 (busy: No available workers)"
                   in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        router.close()


@pytest.mark.slow  # waits out the watchdog's quiet time
def test_a_hung_router_is_found_and_gone_around(backend, caplog):
    """A router that stops answering anything (a SIGSTOPped smg still accepts connections) is found by its watchdog
    (no /generate answer for a while, then no /health answer within 3 s, twice): generation goes straight to the server,
    naming the router, long before request_timeout (before: every request waited request_timeout; nothing but
    generation talked to the router)."""
    held = set()

    async def hang(request):
        held.add(asyncio.current_task())
        await asyncio.sleep(3600)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hang)
    router = ThreadServer(app)
    try:
        client = SGLangClient([backend.address], router=router.address)  # the defaults users run with
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="mega_async.inference.client"):
            got = generate(client, 8)
        assert [len(r.output_tokens) for r in got] == [4] * 8
        assert time.monotonic() - t0 < 45  # not request_timeout (300 s)
        assert client.router_stats() == {"answers": 0, "around": 8}
        assert any(f"router http://{router.address} failed (/health: no answer within 3s (2 times)" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        router._loop.call_soon_threadsafe(lambda: [task.cancel() for task in held])  # the hung handlers end
        router.close()
