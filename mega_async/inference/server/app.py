"""The embedded server's HTTP app: SGLang's native endpoints over the continuous-batching engine.

Endpoints and JSON shapes follow docs/sglang-protocol.md so the same client drives this server and real
SGLang. Request parsing lives in protocol.py, weight updates in updates.py. No pickle anywhere: requests
are JSON, weights are safetensors or torch.distributed broadcasts.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from aiohttp import web

from mega_async.inference.engine import GenerationEngine, GenRequest
from mega_async.inference.server.protocol import (BadRequest, GenerateLimits, clean, handler_error_body,
                                                  parse_generate, validation_error_body)
from mega_async.inference.server.updates import WeightUpdates

logger = logging.getLogger("mega_async.inference.server")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RWLock:
    """Generate requests are readers; a weight update without a pause is the writer."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False

    async def acquire_read(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer)
            self._readers += 1

    async def release_read(self) -> None:
        async with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    async def acquire_write(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer)
            self._writer = True
            await self._cond.wait_for(lambda: self._readers == 0)

    async def release_write(self) -> None:
        async with self._cond:
            self._writer = False
            self._cond.notify_all()


class EmbeddedServer:
    """One model behind SGLang's HTTP protocol; `app()` is the aiohttp application."""

    def __init__(self, model_path: str, *, dtype: str = "float32", device: str = "cpu",
                 weights_root: Optional[str] = None, api_key: Optional[str] = None, max_batch_size: int = 64,
                 seed: int = 0, host: str = "127.0.0.1", port: int = 30000, max_new_tokens_cap: int = 1 << 16,
                 weight_update_timeout_s: float = 300.0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = str(Path(model_path).resolve())
        self.weights_root = Path(weights_root or Path(self.model_path).parent).resolve()
        self.api_key = api_key
        self.host, self.port, self.dtype, self.device = host, port, dtype, device
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=DTYPES[dtype]).to(device)
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        except (OSError, ValueError):
            tokenizer = None
            logger.warning("no tokenizer in %s: text prompts and stop strings are unavailable", self.model_path)
        self.tokenizer = tokenizer
        self.engine = GenerationEngine(model, tokenizer, max_batch_size=max_batch_size, seed=seed)
        self.max_context = int(getattr(model.config, "max_position_embeddings", 1 << 20))
        self.limits = GenerateLimits(model.config.vocab_size, self.max_context, max_new_tokens_cap, tokenizer)
        self._rids: set[str] = set()
        self._paused = False
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._lock = RWLock()
        self.updates = WeightUpdates(self.engine, self._exclusive, self.weights_root, weight_update_timeout_s)
        self._ready = False

    # ---- app -------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth, self._errors], client_max_size=64 << 20)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/rollback_weights", self.rollback_weights)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_get("/v1/models", self.v1_models)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._ready = True

    async def _on_cleanup(self, app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)

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
            return web.json_response(validation_error_body(str(e)), status=400)
        except web.HTTPException:
            raise
        except Exception as e:  # noqa: BLE001 - a handler error answers 400 and the server keeps serving
            logger.exception("%s failed", request.path)
            return web.json_response(handler_error_body(f"{type(e).__name__}: {e}"), status=400)

    async def _json(self, request: web.Request) -> dict:
        if not request.can_read_body:
            raise BadRequest("request body required (send {} at least)")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"invalid JSON body: {e}") from None
        if not isinstance(body, (dict, list)):
            raise BadRequest("JSON body must be an object")
        return body

    # ---- generation ------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if not isinstance(body, dict):
            raise BadRequest("JSON body must be an object")
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the embedded server")
        batch = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
        is_batch = isinstance(batch, list) and bool(batch) and isinstance(batch[0], (list, str))
        reqs = [parse_generate(body, i, self.limits) for i in range(len(batch))] if is_batch \
            else [parse_generate(body, None, self.limits)]
        rids = [r.rid for r, _ in reqs]
        dup = next((r for i, r in enumerate(rids) if r in self._rids or r in rids[:i]), None)
        if dup is not None:
            raise BadRequest(f"Duplicate request id {dup!r}: a request with this rid is still in flight")
        self._rids.update(rids)
        try:
            await self._unpaused.wait()  # new requests wait while generation is paused
            await self._lock.acquire_read()
            try:
                outs = await asyncio.gather(*(self._run(r, lp) for r, lp in reqs))
            finally:
                await self._lock.release_read()
        finally:
            self._rids.difference_update(rids)
        return web.json_response(clean(outs if is_batch else outs[0]))

    async def _run(self, req: GenRequest, return_logprob: bool) -> dict:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        t0 = time.monotonic()

        def done(r: GenRequest) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r))

        req.on_finish = done
        if req.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
        else:
            self.engine.add_request(req)
            try:
                await fut
            except asyncio.CancelledError:  # client went away: free the slot
                self.engine.abort(req.rid)
                raise
        fr = dict(req.finish_reason or {})
        waiting_abort = fr.get("message") == "Abort in waiting queue"
        meta = {
            "id": req.rid,
            "finish_reason": fr,
            "prompt_tokens": 0 if waiting_abort else len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": self.engine.weight_version,
            "e2e_latency": time.monotonic() - t0,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.output_logprobs, req.output_ids)]
            meta["input_token_logprobs"] = []
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    # ---- generation control ----------------------------------------------------------------
    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode must be abort, retract or in_place, got {mode!r}")
        self._paused = True
        self._unpaused.clear()
        self.updates.open_window()
        if mode == "abort":
            await asyncio.wrap_future(self.engine.abort(abort_all=True))
            await asyncio.sleep(0)  # let the aborted requests' responses be assembled
        else:
            self.engine.hold(True)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._json(request)
        self._resume()
        self.updates.close_window()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    def _resume(self) -> None:
        self._paused = False
        self.engine.hold(False)
        self._unpaused.set()

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        rid, abort_all = body.get("rid", ""), bool(body.get("abort_all", False))
        if not rid and not abort_all:
            raise BadRequest("give rid or abort_all=true")
        await asyncio.wrap_future(self.engine.abort(str(rid or ""), abort_all))
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if not self.engine.is_idle():
            return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.\n")
        return web.Response(status=200, text="Cache flushed.\nPlease check backend logs for more details. (When "
                                             "there are running or waiting requests, the operation will not be "
                                             "performed.)\n")

    # ---- weight updates --------------------------------------------------------------------
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
            await self._lock.release_write()

    async def _reply(self, request: web.Request, handler: Callable[[dict], Any]) -> web.Response:
        body = await self._json(request)
        if not isinstance(body, dict):
            raise BadRequest("JSON body must be an object")
        status, out = await handler(body)
        return web.json_response(out, status=status)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        return await self._reply(request, self.updates.from_disk)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        return await self._reply(request, self.updates.init_group)

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        return await self._reply(request, self.updates.from_distributed)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        return await self._reply(request, self.updates.destroy_group)

    async def rollback_weights(self, request: web.Request) -> web.Response:
        return await self._reply(request, self.updates.rollback)

    # ---- information -----------------------------------------------------------------------
    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.engine.model.config
        return web.json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.engine.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": cfg.model_type, "architectures": list(getattr(cfg, "architectures", None) or []),
        })

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path, "host": self.host, "port": self.port, "tp_size": 1, "dp_size": 1,
            "ep_size": 1, "dtype": self.dtype, "device": self.device,
            "max_running_requests": self.engine.max_batch_size,
            "max_total_num_tokens": self.max_context * self.engine.max_batch_size,
            "weight_version": self.engine.weight_version,
            "version": "mega_async-embedded", "weights_root": str(self.weights_root),
            "num_running_reqs": self.engine.num_running, "num_waiting_reqs": self.engine.num_waiting,
        })

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self._ready else 503)

    async def v1_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_path, "object": "model", "created": 0, "owned_by": "mega_async",
             "root": self.model_path}]})
