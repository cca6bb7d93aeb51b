"""`SGLangClient.abort_in_flight`, the bracket's step before an abort pause on real SGLang (whose pause sleeps a
second while request handlers hold its lock): a request that reached the server only after the first
/abort_request, so still runs, is aborted by the next one, also while another server gives no answer (which holds
the wait to its limit, no longer)."""
import asyncio
import socket

from aiohttp import web

from mega_async.inference.client import REABORT_S, SGLangClient
from mega_async.api.sglang_releases import Release
from tests.unit.thread_server import ThreadServer


class LateServer(ThreadServer):
    """A real SGLang server (its release learned): the first /abort_request finds nothing (the request is still on
    its way), a later one aborts it: its answer comes back then (the client's count of it drops)."""

    def __init__(self, on_abort):
        self.aborts, self.on_abort = 0, on_abort
        app = web.Application()
        app.router.add_post("/abort_request", self._abort)
        super().__init__(app)

    async def _abort(self, request):
        assert (await request.json())["abort_all"] is True
        self.aborts += 1
        if self.aborts == 2:
            self.on_abort()
        return web.Response(status=200)


def test_a_request_that_arrived_after_the_abort_is_aborted_again_and_a_mute_server_is_not_waited_for():
    mute = socket.socket()  # accepts connections (the kernel does) and never answers: a stopped process
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    client = None

    async def main():
        nonlocal client
        loop = asyncio.get_running_loop()
        server = LateServer(lambda: loop.call_soon_threadsafe(client._count, client.servers[0], -1))
        client = SGLangClient([server.address, f"127.0.0.1:{mute.getsockname()[1]}"], request_timeout=30)
        for s in client.servers:  # learned when the sync began (the distributed sync asks at its setup)
            s.release = Release.of("0.5.23")
        try:
            client._count(client.servers[0], 1)  # one request of ours on the server
            client._count(client.servers[1], 1)  # and one on the mute one (never comes back)
            assert REABORT_S <= 0.2
            left = await client.abort_in_flight(1.5)
            return left, server.aborts
        finally:
            server.close()

    try:
        left, aborts = asyncio.run(main())
    finally:
        mute.close()
    assert aborts >= 2  # a second abort came REABORT_S after the first, while the mute one was still unanswered
    assert left == 1  # the mute server's, not waited for beyond the limit
    assert client.servers[0].in_flight == 0 and client.servers[1].in_flight == 1


def test_a_server_that_cannot_say_its_release_in_time_is_left_to_the_pause_not_marked_down():
    """A release not known yet is asked within the wait's limit; a server that does not answer stays up (the pause,
    with the sync's own timeout, decides about it) and is not aborted ahead."""
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    try:
        client = SGLangClient([f"127.0.0.1:{mute.getsockname()[1]}"], request_timeout=30)
        client._count(client.servers[0], 1)
        assert asyncio.run(client.abort_in_flight(0.5)) == 1
        assert client.servers[0].healthy and client.servers[0].release is None
    finally:
        mute.close()
