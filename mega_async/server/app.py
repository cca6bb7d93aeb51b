"""The embedded server's HTTP app: SGLang's native endpoints over the continuous-batching engine.

Endpoints and JSON shapes follow docs/sglang-protocol.md so the same client drives this server and real
SGLang. Request parsing lives in generate_protocol.py and protocol.py, weight updates in updates.py, the
OpenAI-compatible endpoints in openai_api.py. No pickle anywhere: requests are JSON, weights are
safetensors or torch.distributed broadcasts.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional

import torch
from aiohttp import web

from mega_async.server.connections import ConnectionLimits, middlewares
from mega_async.server.engine import EngineRefused, GenerationEngine, GenRequest
from mega_async.server.generate_protocol import (GenerateLimits, Options, check_text, parse_generate,
                                                           prompt_items, response_body)
from mega_async.server.info import InfoEndpoints
from mega_async.server.memory import MemoryOccupation, parse_tags
from mega_async.server.openai_api import OpenAIEndpoints
from mega_async.server.protocol import (QUEUE_FULL, BadRequest, BodyUnparsable, QueueFull, ValueRejected,
                                                  clean, error_body, handler_error_body, http_error_body,
                                                  validate_request)
from mega_async.server.updates import WeightUpdates
from mega_async.server.weight_checker import WeightChecker, parse_check
from mega_async.server.weight_checker import reply_body as checker_reply
from mega_async.server.weights import load_pretrained
from mega_async.api.sglang_releases import MIRRORED_DEFAULT, Release

logger = logging.getLogger("mega_async.server")

UNPARSABLE = "There was an error parsing the body"  # FastAPI's words, as SGLang answers them
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RWLock:
    """Generate requests are readers; a weight update without a pause is the writer (a waiting writer holds
    back new readers).

    Cancellation-safe: handlers are cancelled when their client disconnects, at any await. An acquire that is
    cancelled takes nothing (a writer cancelled while it waits for the readers gives the lock back), and the
    releases do not await, so a handler cancelled in its `finally` still releases.
    """

    def __init__(self) -> None:
        self._readers = 0
        self._writer = False  # held by a writer, or claimed by one waiting for the readers to finish
        self._waiters: list[asyncio.Future] = []

    def _wake(self) -> None:
        for f in self._waiters:
            if not f.done():
                f.set_result(None)
        self._waiters.clear()

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            f = asyncio.get_running_loop().create_future()
            self._waiters.append(f)
            try:
                await f
            finally:
                if f in self._waiters:
                    self._waiters.remove(f)

    async def acquire_read(self) -> None:
        await self._wait_until(lambda: not self._writer)
        self._readers += 1

    def release_read(self) -> None:
        self._readers -= 1
        self._wake()

    async def acquire_write(self) -> None:
        await self._wait_until(lambda: not self._writer)
        self._writer = True
        try:
            await self._wait_until(lambda: self._readers == 0)
        except BaseException:  # cancelled (its client gave up): the readers it held back may run again
            self.release_write()
            raise

    def release_write(self) -> None:
        self._writer = False
        self._wake()


class Tracked:
    """One engine request seen from the event loop: `changed` fires on each new token and at the end."""

    def __init__(self, req: GenRequest, opts: Options, loop: asyncio.AbstractEventLoop) -> None:
        self.req, self.opts, self.t0 = req, opts, time.monotonic()
        self.done = loop.create_future()
        self.changed = asyncio.Event()

        def wake(_: GenRequest) -> None:
            loop.call_soon_threadsafe(self.changed.set)

        def finish(r: GenRequest) -> None:
            loop.call_soon_threadsafe(lambda: (self.changed.set(), self.done.done() or self.done.set_result(r)))

        req.on_finish, req.on_step = finish, None
        self._wake = wake

    def stream(self) -> None:
        self.req.on_step = self._wake


def max_token_chars(tokenizer: Any) -> int:
    if tokenizer is None:
        return 64
    try:
        return max(8, max(len(t) for t in tokenizer.get_vocab()))
    except Exception:  # noqa: BLE001 - an odd tokenizer: a generous bound
        return 64


class EmbeddedServer:
    """One model behind SGLang's HTTP protocol; `app()` is the aiohttp application."""

    def __init__(self, model_path: str, *, dtype: str = "float32", device: str = "cpu",
                 weights_root: Optional[str] = None, api_key: Optional[str] = None, max_batch_size: int = 64,
                 seed: int = 0, host: str = "127.0.0.1", port: int = 30000, max_new_tokens_cap: int = 1 << 16,
                 weight_update_timeout_s: float = 300.0, prefix_cache_tokens: int = 1 << 16,
                 enable_return_routed_experts: bool = False, served_model_name: Optional[str] = None,
                 sglang_version: str = MIRRORED_DEFAULT, enable_memory_saver: bool = False,
                 enable_custom_logit_processor: bool = False, max_queued_requests: Optional[int] = None,
                 max_requests_per_body: int = 1 << 14, connection_limits: ConnectionLimits = ConnectionLimits()):
        from transformers import AutoTokenizer

        self.model_path = str(Path(model_path).resolve())
        self.served_model_name = served_model_name or self.model_path
        self.weights_root = Path(weights_root or Path(self.model_path).parent).resolve()
        self.api_key = api_key
        self.connection_limits = connection_limits  # the body's deadline here; the header's and the cap in serve()
        self.host, self.port, self.dtype, self.device = host, port, dtype, device
        self.enable_return_routed_experts = enable_return_routed_experts
        # reported in /server_info as started (SGLang's flags, default off); memory is released either way
        self.enable_memory_saver, self.enable_custom_logit_processor = enable_memory_saver, enable_custom_logit_processor
        model = load_pretrained(self.model_path, DTYPES[dtype], device)  # FP8 block checkpoints dequantized
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        except (OSError, ValueError):
            tokenizer = None
            logger.warning("no tokenizer in %s: text prompts and stop strings are unavailable", self.model_path)
        self.tokenizer = tokenizer
        self.engine = GenerationEngine(model, tokenizer, max_batch_size=max_batch_size, seed=seed,
                                       prefix_cache_tokens=prefix_cache_tokens,
                                       record_routes=enable_return_routed_experts)
        self.max_context = int(getattr(model.config, "max_position_embeddings", 1 << 20))
        self.limits = GenerateLimits(model.config.vocab_size, self.max_context, max_new_tokens_cap, tokenizer,
                                     max_token_chars(tokenizer), max_requests_per_body)
        self.max_queued_requests = max_queued_requests  # SGLang's --max-queued-requests (None: no bound, its default)
        self._held = 0  # requests waiting at the pause gate: SGLang queues those in its waiting queue
        self.memory = MemoryOccupation(self.engine)
        self._rids: set[str] = set()
        self._paused = False
        self._closing = False
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._lock = RWLock()
        self.release = Release.of(sglang_version)  # the SGLang release whose protocol this server mirrors
        if self.release.sessions is None:
            raise ValueError(f"sglang_version {sglang_version!r}: give a release such as {MIRRORED_DEFAULT}")
        self.updates = WeightUpdates(self.engine, self._exclusive, self.weights_root, weight_update_timeout_s,
                                     self.release)
        self.checker = WeightChecker(self.engine.model, self.release)
        self.info = InfoEndpoints(self)
        self._ready = False

    # ---- app -------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[*middlewares(self.connection_limits, self._auth), self._errors],
                              client_max_size=64 << 20)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("*", "/flush_cache", self.flush_cache)
        for path, fn in (("/update_weights_from_disk", self.updates.from_disk),
                         ("/init_weights_update_group", self.updates.init_group),
                         ("/update_weights_from_distributed", self.updates.from_distributed),
                         ("/destroy_weights_update_group", self.updates.destroy_group),
                         ("/rollback_weights", self.updates.rollback),
                         ("/update_weights_from_tensor", self.updates.from_tensor),
                         ("/update_weight_version", self.updates.set_version)):
            r.add_post(path, self._replier(fn))
        if self.release.sessions:  # SGLang 0.5.21+
            r.add_post("/begin_weight_update", self._replier(self.updates.begin_session))
            r.add_post("/end_weight_update", self._replier(self.updates.end_session))
        r.add_route("*", "/weights_checker", self.weights_checker)
        r.add_post("/post_process_weights", self._replier(self.post_process_weights))
        r.add_route("*", "/release_memory_occupation", self.release_memory)
        r.add_route("*", "/resume_memory_occupation", self.resume_memory)
        self.info.register(r)
        OpenAIEndpoints(self).register(r)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._ready = True

    async def _on_shutdown(self, app: web.Application) -> None:
        """SIGTERM: stop generating now (every open request is answered as aborted), not after it finishes."""
        self._closing, self._ready = True, False
        self._unpaused.set()
        await asyncio.wrap_future(self.engine.abort(abort_all=True))
        await asyncio.sleep(0)

    async def _on_cleanup(self, app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)
        self.memory.close()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.api_key and not request.path.startswith("/health"):
            if request.headers.get("Authorization", "") != f"Bearer {self.api_key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except BadRequest as e:
            return web.json_response(error_body(e), status=400)
        except QueueFull as e:  # SGLang's HTTPException(503) through its handler
            return web.json_response(http_error_body(str(e), 503), status=503)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as e:  # SGLang's ErrorResponse for Starlette's
            return web.json_response({"object": "error", "message": e.reason, "type": str(e.status),
                                      "param": None, "code": e.status}, status=e.status)
        except web.HTTPException:
            raise
        except RecursionError:  # a client's nesting too deep for some reader: one line, not a traceback each time
            logger.warning("%s failed: RecursionError (a value nested too deep)", request.path)
            return web.json_response(handler_error_body("RecursionError: a value in the body is nested too deep"),
                                     status=400)
        except Exception as e:  # noqa: BLE001 - a handler error answers 400 and the server keeps serving
            logger.exception("%s failed", request.path)
            return web.json_response(handler_error_body(f"{type(e).__name__}: {e}"), status=400)

    async def json_body(self, request: web.Request) -> Any:
        if not request.body_exists:
            raise BadRequest("request body required (send {} at least)")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"invalid JSON body: {e}") from None
        except RecursionError:  # SGLang (FastAPI): "There was an error parsing the body", 400, nothing logged
            raise BodyUnparsable(f"{UNPARSABLE}: JSON nested deeper than the parser's limit; flatten it") from None
        except ValueError:  # an integer of more than 4300 digits (Python's int limit)
            raise BodyUnparsable(f"{UNPARSABLE}: an integer of more than 4300 digits; send a shorter "
                                 "number") from None
        if not isinstance(body, (dict, list)):
            raise BadRequest("JSON body must be an object")
        return body

    async def _dict_body(self, request: web.Request) -> dict:
        body = await self.json_body(request)
        if not isinstance(body, dict):
            raise BadRequest("JSON body must be an object")
        return body

    async def _model_body(self, request: web.Request) -> dict:
        """A control endpoint's body, coerced field by field as SGLang's request model (protocol.REQUEST_MODELS)."""
        return validate_request(request.path, await self._dict_body(request))

    # ---- generation ------------------------------------------------------------------------
    async def tokenize(self, items: list[Any]) -> list[list[int]]:
        """Token ids of each prompt; text is bounded first and tokenized off the event loop."""
        texts = [i for i, x in enumerate(items) if not isinstance(x, list)]
        for i in texts:
            check_text(items[i], self.limits)
        if not texts:
            return list(items)
        tok = self.tokenizer
        loop = asyncio.get_running_loop()
        enc = await loop.run_in_executor(None, lambda: [tok(items[i], add_special_tokens=False)["input_ids"]
                                                        for i in texts])
        out = list(items)
        for i, ids in zip(texts, enc):
            out[i] = ids
        return out

    async def prepare(self, body: dict) -> tuple[list[tuple[GenRequest, Options]], bool]:
        items, is_batch = prompt_items(body)
        prompts = await self.tokenize(items)
        reqs = parse_generate(body, prompts, is_batch, self.limits, self.enable_return_routed_experts,
                              self.enable_custom_logit_processor)
        return reqs, is_batch or len(reqs) > 1

    def _refuse_if_released(self) -> None:
        if self.engine.released:
            raise ValueRejected(f"memory is released ({', '.join(sorted(self.engine.released))}): call "
                                "/resume_memory_occupation before generating")

    def _claim_rids(self, rids: list[str]) -> None:
        seen: set[str] = set()
        for r in rids:  # linear: a body's rids against each other and the open ones
            if r in self._rids or r in seen:
                raise ValueRejected(f"Duplicate request ID detected: {r}")
            seen.add(r)
        self._rids.update(seen)

    def _queue_room(self) -> Optional[int]:
        """How many more requests SGLang's waiting queue would take (--max-queued-requests); None: no bound."""
        if self.max_queued_requests is None:
            return None
        return max(0, self.max_queued_requests - self.engine.num_waiting - self._held)

    async def submit(self, reqs: list[tuple[GenRequest, Options]], stream: bool = False) -> list[Tracked]:
        """Wait while paused, then hand the requests to the engine. max_new_tokens 0 is SGLang's prefill-only
        request: one forward over the prompt (its KV cached, prompt logprobs or routes where asked), no sample.

        Past --max-queued-requests, SGLang's refusal: a whole non-streaming body is answered 503 before anything
        runs; a stream's requests past the room finish at once as aborted with status_code 503 (SGLang's
        per-request abort) and the others run."""
        room = self._queue_room()
        if room is not None and len(reqs) > room and not stream:
            raise QueueFull(QUEUE_FULL)
        full = set() if room is None else {id(r) for r, _ in reqs[room:]}
        if len(full) < len(reqs):  # a stream refused whole is answered at once, even while paused
            self._held += len(reqs) - len(full)
            try:
                await self._unpaused.wait()  # new requests wait while generation is paused
            finally:
                self._held -= len(reqs) - len(full)
        if self._closing:
            raise web.HTTPServiceUnavailable(text="server shutting down")
        self._refuse_if_released()
        loop = asyncio.get_running_loop()
        tracked = [Tracked(r, o, loop) for r, o in reqs]
        for t in tracked:
            if id(t.req) in full:
                t.req.finish_reason = {"type": "abort", "status_code": 503, "message": QUEUE_FULL}
                t.done.set_result(t.req)
        tracked_all, tracked = tracked, [t for t in tracked if id(t.req) not in full]
        scored = []
        for t in tracked:
            if stream:
                t.stream()
            if t.req.max_new_tokens > 0:
                self.engine.add_request(t.req)
            else:  # SGLang prefills every max_new_tokens 0 request (its KV goes into the radix cache)
                scored.append(t.req)
        if scored:
            self.engine.score(scored)
        return tracked_all

    async def run_all(self, reqs: list[tuple[GenRequest, Options]],
                      body_fn: Optional[Callable[[Tracked], Any]] = None) -> list[Any]:
        """Run requests to the end under the reader lock; a cancelled handler (client gone) aborts them."""
        self._claim_rids([r.rid for r, _ in reqs])
        tracked: list[Tracked] = []
        try:
            await self._lock.acquire_read()
            try:
                tracked = await self.submit(reqs)
                await asyncio.gather(*(t.done for t in tracked))
            finally:
                self._lock.release_read()
        except asyncio.CancelledError:
            for t in tracked:
                self.engine.cancel(t.req)
            raise
        finally:
            self._rids.difference_update(r.rid for r, _ in reqs)
        return [(body_fn or self.body)(t) for t in tracked]

    def body(self, t: Tracked) -> dict:
        return response_body(t.req, t.opts, self.engine.weight_version, time.monotonic() - t.t0, self.tokenizer)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await self._dict_body(request)
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise BadRequest(f"stream must be a boolean, got {stream!r}")
        reqs, many = await self.prepare(body)
        if stream:
            return await self._stream(request, reqs, many)
        outs = await self.run_all(reqs)
        return web.json_response(clean(outs if many else outs[0]))

    @contextlib.asynccontextmanager
    async def streaming(self, request: web.Request, reqs: list[tuple[GenRequest, Options]]
                        ) -> AsyncIterator[tuple[web.StreamResponse, list[Tracked]]]:
        """An SSE response's bracket (native and OpenAI streams): rids claimed, the response prepared and the
        requests submitted; however the stream ends (client gone, an error), its unfinished requests are
        cancelled; the rids are released at the end."""
        self._claim_rids([r.rid for r, _ in reqs])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        tracked: list[Tracked] = []
        try:
            await resp.prepare(request)
            tracked.extend(await self.submit(reqs, stream=True))
            yield resp, tracked
        finally:
            for t in tracked:
                if not t.done.done():  # nobody reads it any more: free its row before the next decode step
                    self.engine.cancel(t.req)
            self._rids.difference_update(r.rid for r, _ in reqs)

    @staticmethod
    async def next_change(tracked: list[Tracked], timeout: float = 1.0) -> None:
        """Until one unfinished request has new tokens (or `timeout`); the other waiters are cancelled."""
        waits = [asyncio.ensure_future(t.changed.wait()) for t in tracked if not t.done.done()]
        if not waits:
            return
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED, timeout=timeout)
        finally:
            for w in waits:
                w.cancel()

    async def _stream(self, request: web.Request, reqs: list[tuple[GenRequest, Options]],
                      many: bool) -> web.StreamResponse:
        """SSE as SGLang streams /generate: each event is the whole response so far; then `data: [DONE]`."""
        async with self.streaming(request, reqs) as (resp, tracked):
            sent = [-1] * len(tracked)
            while True:
                for k, t in enumerate(tracked):
                    if sent[k] == -2:
                        continue
                    t.changed.clear()  # before reading: a token after this wakes next_change again
                    n, fin = len(t.req.output_ids), t.done.done()
                    if not (fin or n - max(sent[k], 0) >= t.opts.stream_interval):
                        continue  # below its stream_interval: wait for more (not a busy loop)
                    chunk = self.body(t)
                    if many:
                        chunk["index"] = k
                    await resp.write(b"data: " + json.dumps(clean(chunk)).encode() + b"\n\n")
                    sent[k] = -2 if fin else n
                if all(s == -2 for s in sent):
                    break
                await self.next_change(tracked)
            await resp.write(b"data: [DONE]\n\n")
        return resp

    # ---- generation control ----------------------------------------------------------------
    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await self._model_body(request))["mode"]
        self._paused = True
        self._unpaused.clear()
        self.updates.open_window()
        await asyncio.wrap_future(self.engine.pause(mode))
        await asyncio.sleep(0)  # let the aborted requests' responses be assembled
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._model_body(request)
        await asyncio.wrap_future(self.engine.resume())
        self._paused = False
        self._unpaused.set()
        self.updates.close_window()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._model_body(request)
        rid, abort_all = body["rid"] or "", body["abort_all"]
        if rid or abort_all:  # neither: SGLang ignores the request (an empty rid would match every request)
            await asyncio.wrap_future(self.engine.abort(rid, abort_all))
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if not await asyncio.wrap_future(self.engine.run_command(self.engine.flush_cache)):
            return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.\n")
        return web.Response(status=200, text="Cache flushed.\nPlease check backend logs for more details. (When "
                                             "there are running or waiting requests, the operation will not be "
                                             "performed.)\n")

    async def _memory(self, request: web.Request, fn: Callable[[list[str]], None]) -> web.Response:
        body = await self._model_body(request) if request.body_exists else {}
        try:
            tags = parse_tags(body)
            await asyncio.wrap_future(self.engine.run_command(lambda: fn(tags)))
        except (ValueError, EngineRefused) as e:
            return web.json_response(handler_error_body(str(e)), status=400)
        return web.json_response(None)

    async def release_memory(self, request: web.Request) -> web.Response:
        return await self._memory(request, self.memory.release)

    async def resume_memory(self, request: web.Request) -> web.Response:
        return await self._memory(request, self.memory.resume)

    async def weights_checker(self, request: web.Request) -> web.Response:
        """GET|POST /weights_checker {"action": checksum|snapshot|compare|reset_tensors, ...}, as SGLang."""
        body = await self.json_body(request) if request.body_exists else None
        if body is not None and not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        action, skip, _selector = parse_check(validate_request("/weights_checker", body) if body else body)
        ok, message, ranks = await asyncio.wrap_future(
            self.engine.run_command(lambda: self.checker.handle(action, skip)))
        return web.json_response(checker_reply(ok, message, ranks), status=200 if ok else 400)

    # ---- weight updates --------------------------------------------------------------------
    async def post_process_weights(self, body: dict) -> tuple[int, dict]:
        """POST /post_process_weights {restore_weights_before_load, post_process_quantization}: SGLang's hook that
        repacks quantized or kernel-layout weights after a refit. This server keeps every weight in its load
        layout, unquantized, so there is nothing to do: success, as SGLang answers a model without such layers."""
        return 200, {"success": True, "message": "Success"}

    async def _exclusive(self, body: dict, fn: Any) -> Any:
        """Run fn on the engine thread; without a pause, wait for in-flight requests first (writer lock)."""
        if body.get("abort_all_requests"):
            await asyncio.wrap_future(self.engine.abort(abort_all=True))
        if self._paused:
            return await asyncio.wrap_future(self.engine.run_command(fn))
        await self._lock.acquire_write()
        try:
            return await asyncio.wrap_future(self.engine.run_command(fn))
        finally:
            self._lock.release_write()

    def _replier(self, handler: Callable[[dict], Any]) -> Callable[[web.Request], Any]:
        async def reply(request: web.Request) -> web.Response:
            body = await self._dict_body(request)
            if request.path != "/update_weights_from_distributed":  # validated by its handler, which rolls back
                body = validate_request(request.path, body)    # a pause window first
            status, out = await handler(body)
            return web.json_response(out, status=status)

        return reply
