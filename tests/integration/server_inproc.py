"""An embedded server in the test process (its own event loop thread): cheap to start, and as the CLI runs it
(handler_cancellation: a client that disconnects cancels its handler). For tests that wedge or reconfigure a
server, so the shared `server` fixture is never disturbed."""
import asyncio
import threading
from typing import Any

from aiohttp import web

from mega_async.utils.comm import free_port
from mega_async.server.app import EmbeddedServer


class InProcessServer:
    def __init__(self, model_path: str, **kwargs: Any) -> None:
        self.port = free_port()
        self.server = EmbeddedServer(model_path, port=self.port, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(self.server.app(), handler_cancellation=True, shutdown_timeout=2.0)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="inproc-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("in-process server did not start within 60 s")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        """Stop serving (open requests are answered as aborted) and join the engine thread, within bounds."""
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        try:
            fut.result(timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> "InProcessServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
