"""One answer's body is bounded (mega_async.inference.client.transport.MAX_RESPONSE_BYTES): a server, or whatever answers at
its address, that sends a huge body (declared, or streamed without a length) gets a one-line error instead of
filling the trainer's memory; ordinary answers decode as aiohttp's json()/text() would."""
import asyncio

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from mega_async.inference.client import ServerError, SGLangClient


async def _serve_and_call(path: str, cap: int):
    async def declared(request):
        return web.Response(body=b"x" * 5000, content_type="text/plain")

    async def streamed(request):
        r = web.StreamResponse()
        r.enable_chunked_encoding()
        await r.prepare(request)
        for _ in range(100):  # endless to a reader with no bound (100 x 1 kB here)
            await r.write(b"y" * 1000)
        await r.write_eof()
        return r

    async def small(request):
        return web.json_response({"ok": True, "text": "é"})

    async def empty(request):
        return web.Response(body=b"  ", content_type="application/json")

    app = web.Application()
    app.router.add_get("/declared", declared)
    app.router.add_get("/streamed", streamed)
    app.router.add_get("/small", small)
    app.router.add_get("/empty", empty)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            return await SGLangClient._send(session, "GET", URL(f"http://127.0.0.1:{port}{path}"), {}, cap=cap)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("path,what", [("/declared", "5000-byte body"), ("/streamed", "body past the 4096-byte")])
def test_a_body_past_the_bound_is_refused_in_one_line(path, what):
    with pytest.raises(ServerError) as e:
        asyncio.run(_serve_and_call(path, cap=4096))
    assert what in str(e.value) and path in str(e.value) and "\n" not in str(e.value)


def test_ordinary_answers_decode_as_before():
    assert asyncio.run(_serve_and_call("/small", cap=4096)) == (200, {"ok": True, "text": "é"})
    assert asyncio.run(_serve_and_call("/empty", cap=4096)) == (200, None)
    assert asyncio.run(_serve_and_call("/declared", cap=1 << 20)) == (200, "x" * 5000)


def test_retry_after_is_read_as_rfc_9110_says_and_bounded():
    """delay-seconds or an HTTP date; absent, negative, garbage or a date past parsing is None (the client's own
    backoff); a huge value is clipped here and again by BUSY_WAIT_MAX_S where it is used."""
    import email.utils
    import time

    from mega_async.inference.client.transport import BUSY_WAIT_MAX_S, _retry_after

    assert _retry_after("3") == 3.0 and _retry_after(" 0 ") == 0.0
    assert _retry_after("99999999999999999999") == 10 ** 6 and BUSY_WAIT_MAX_S == 30.0
    assert all(_retry_after(v) is None for v in (None, "", "-1", "1.5", "soon", "Mon, 99 Foo 2026 99:99:99 GMT"))
    later = _retry_after(email.utils.formatdate(time.time() + 20, usegmt=True))
    assert later is not None and 15 <= later <= 21
    assert _retry_after(email.utils.formatdate(time.time() - 60, usegmt=True)) == 0.0
