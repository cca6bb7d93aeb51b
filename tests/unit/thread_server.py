"""An aiohttp application served on a loopback port from a daemon thread with its own event loop, for tests that
need a small fake server beside a client running in the test's own loop."""
import asyncio
import socket
import threading

from aiohttp import web


class ThreadServer:
    """Serves `app` on 127.0.0.1 (a free port) until `close()`; `address` is host:port."""

    def __init__(self, app: web.Application):
        self._runner = web.AppRunner(app)
        self._loop = asyncio.new_event_loop()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{sock.getsockname()[1]}"
        ready = threading.Event()

        def main():
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.SockSite(self._runner, sock).start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, daemon=True)
        self._thread.start()
        ready.wait(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
