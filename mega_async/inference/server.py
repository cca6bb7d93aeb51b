"""Embedded inference server: SGLang's native HTTP protocol over a transformers model (CPU or GPU).

    python -m mega_async.inference.server --model models/tiny-qwen3-moe --host 127.0.0.1 --port 30000

Endpoints and JSON shapes follow docs/sglang-protocol.md so the same client drives this server
and real SGLang. Weight updates: from disk (only under --weights-root) or by torch.distributed
broadcast from trainer rank 0. No pickle anywhere: requests are JSON, weights are safetensors.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
from aiohttp import web

from mega_async.inference.dist_group import WeightGroup
from mega_async.inference.engine import GenerationEngine, GenRequest
from mega_async.inference.weights import WeightLoadError, load_named_tensors, read_safetensors_dir

logger = logging.getLogger("mega_async.inference.server")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BadRequest(Exception):
    """Invalid request: SGLang answers these with its OpenAI-style error body."""


def _validation_error(msg: str) -> web.Response:
    body = {"object": "error", "message": msg, "type": "Bad Request", "param": None, "code": 400}
    return web.json_response(body, status=400)


def _handler_error(msg: str) -> web.Response:
    return web.json_response({"error": {"message": msg}}, status=400)


def _clean(x: Any) -> Any:
    """NaN/inf -> null, as SGLang's ORJSON serialisation does."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, list):
        return [_clean(v) for v in x]
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    return x


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
    def __init__(self, model_path: str, *, dtype: str = "float32", device: str = "cpu",
                 weights_root: Optional[str] = None, api_key: Optional[str] = None, max_batch_size: int = 64,
                 seed: int = 0, host: str = "127.0.0.1", port: int = 30000, max_new_tokens_cap: int = 1 << 16):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = str(Path(model_path).resolve())
        self.weights_root = Path(weights_root or Path(self.model_path).parent).resolve()
        self.api_key = api_key
        self.host, self.port, self.dtype, self.device = host, port, dtype, device
        self.max_new_tokens_cap = max_new_tokens_cap
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=DTYPES[dtype]).to(device)
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        except (OSError, ValueError):
            tokenizer = None
            logger.warning("no tokenizer in %s: text prompts and stop strings are unavailable", self.model_path)
        self.tokenizer = tokenizer
        self.engine = GenerationEngine(model, tokenizer, max_batch_size=max_batch_size, seed=seed)
        self.vocab_size = model.config.vocab_size
        self.max_context = int(getattr(model.config, "max_position_embeddings", 1 << 20))
        self._rids: set[str] = set()
        self._paused = False
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._lock = RWLock()
        self._groups: dict[str, WeightGroup] = {}
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
            return _validation_error(str(e))
        except web.HTTPException:
            raise
        except Exception as e:  # noqa: BLE001 - a handler error answers 400 and the server keeps serving
            logger.exception("%s failed", request.path)
            return _handler_error(f"{type(e).__name__}: {e}")

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
    def _parse_one(self, body: dict, idx: Optional[int] = None) -> tuple[GenRequest, bool]:
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object")
        ids = body.get("input_ids")
        if idx is not None:
            ids = ids[idx] if ids is not None else None
        text = body.get("text")
        if idx is not None and text is not None:
            text = text[idx]
        if ids is None:
            if text is None:
                raise BadRequest("either text or input_ids should be provided")
            if self.tokenizer is None:
                raise BadRequest("this server has no tokenizer: send input_ids")
            if not isinstance(text, str):
                raise BadRequest("text must be a string")
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest("input_ids must be a non-empty list of integers")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"input_ids contain token id {bad[0]} outside [0, {self.vocab_size})")

        def num(key: str, default: Any, kind: type) -> Any:
            v = sp.get(key, default)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
                raise BadRequest(f"sampling_params.{key} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
            return kind(v)

        max_new = num("max_new_tokens", 128, int)
        temperature = num("temperature", 1.0, float)
        top_p = num("top_p", 1.0, float)
        top_k = num("top_k", -1, int)
        if max_new < 0:
            raise BadRequest(f"max_new_tokens must be at least 0, got {max_new}")
        if max_new > self.max_new_tokens_cap or len(ids) + max_new > self.max_context:
            raise BadRequest(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new}) exceeds the context length {self.max_context}"
            )
        if temperature < 0:
            raise BadRequest(f"temperature must be non-negative, got {temperature}")
        if not 0 < top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 1 and top_k != -1:
            raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {top_k}")
        stop_ids = sp.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
            raise BadRequest("stop_token_ids must be a list of integers")
        stop = sp.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest("stop must be a string or a list of strings")
        rid = body.get("rid")
        if idx is not None and isinstance(rid, list):
            rid = rid[idx]
        rid = str(rid) if rid is not None else uuid.uuid4().hex
        if idx is not None and body.get("rid") is not None and not isinstance(body.get("rid"), list):
            rid = f"{rid}-{idx}"
        req = GenRequest(rid=rid, input_ids=list(ids), max_new_tokens=max_new, temperature=temperature, top_p=top_p,
                         top_k=top_k, stop_token_ids=set(stop_ids), stop=stop, ignore_eos=bool(sp.get("ignore_eos", False)))
        return req, bool(body.get("return_logprob", False))

    async def generate(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if not isinstance(body, dict):
            raise BadRequest("JSON body must be an object")
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the embedded server")
        batch = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
        is_batch = isinstance(batch, list) and bool(batch) and isinstance(batch[0], (list, str))
        reqs = [self._parse_one(body, i) for i in range(len(batch))] if is_batch else [self._parse_one(body)]
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
        return web.json_response(_clean(outs if is_batch else outs[0]))

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
        if mode == "abort":
            await asyncio.wrap_future(self.engine.abort(abort_all=True))
            await asyncio.sleep(0)  # let the aborted requests' responses be assembled
        else:
            self.engine.hold(True)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._json(request)
        self._resume()
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
        return web.Response(status=200, text="Cache flushed.\nPlease check backend logs for more details. "
                                             "(When there are running or waiting requests, the operation will not be performed.)\n")

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

    def _allowed_dir(self, path: Any) -> Path:
        if not isinstance(path, str) or not path:
            raise WeightLoadError("model_path must be a non-empty string")
        p = Path(path).resolve()
        if not p.is_relative_to(self.weights_root):
            raise WeightLoadError(f"model_path {path} is outside the allowed weights root {self.weights_root} "
                                  "(start the server with --weights-root)")
        if not p.is_dir():
            raise WeightLoadError(f"model_path {path} is not a directory")
        return p

    def _set_version(self, body: dict) -> None:
        v = body.get("weight_version")
        if v is not None:
            self.engine.weight_version = str(v)

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        loop = asyncio.get_running_loop()
        try:
            d = self._allowed_dir(body.get("model_path"))
            fmt = body.get("load_format")
            if fmt not in (None, "auto", "safetensors"):
                raise WeightLoadError(f"load_format {fmt!r} is not supported (safetensors only)")
            tensors = await loop.run_in_executor(None, lambda: list(read_safetensors_dir(d)))
            n = await self._exclusive(body, lambda: load_named_tensors(self.engine.model, tensors, strict=True))
        except (WeightLoadError, OSError, ValueError) as e:
            return web.json_response({"success": False, "message": f"Failed to update weights: {e}. "
                                      "Rolled back to the previous weights.", "num_paused_requests": 0}, status=400)
        self._set_version(body)
        logger.info("loaded %d tensors from %s (version %s)", n, d, self.engine.weight_version)
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        try:
            name = str(body.get("group_name", "weight_update_group"))
            if name in self._groups:
                raise ValueError(f"group {name!r} already exists; destroy it first")
            rank = int(body.get("rank_offset", 1))
            args = (str(body.get("backend") or "gloo"), str(body["master_address"]), int(body["master_port"]),
                    int(body["world_size"]), rank, name)
            loop = asyncio.get_running_loop()
            self._groups[name] = await loop.run_in_executor(None, lambda: WeightGroup(*args))
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            return web.json_response({"success": False, "message": f"Failed to init group: {e!r}"}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        try:
            group = self._groups.get(str(body.get("group_name", "weight_update_group")))
            if group is None:
                raise ValueError(f"no weight update group {body.get('group_name')!r}: call /init_weights_update_group")
            names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
            if not (len(names) == len(dtypes) == len(shapes)):
                raise ValueError("names, dtypes and shapes must have the same length")
            bufs = []
            for n, dt, sh in zip(names, dtypes, shapes):
                dt = str(dt).replace("torch.", "")
                if dt not in DTYPES:
                    raise ValueError(f"unsupported dtype {dt!r} for {n}")
                bufs.append(torch.empty([int(s) for s in sh], dtype=DTYPES[dt]))
            loop = asyncio.get_running_loop()

            def receive() -> None:
                for t in bufs:  # in the order the trainer broadcasts them
                    group.broadcast(t, src=0)

            await loop.run_in_executor(None, receive)
            n = await self._exclusive(body, lambda: load_named_tensors(self.engine.model, list(zip(names, bufs))))
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            return web.json_response({"success": False, "message": f"Failed to update weights: {e}"}, status=400)
        self._set_version(body)
        return web.json_response({"success": True, "message": f"Succeeded to update {n} parameters."})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        g = self._groups.pop(str(body.get("group_name", "weight_update_group")), None)
        if g is None:
            return web.json_response({"success": False, "message": "no such group"}, status=400)
        g.destroy()
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

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
            "ep_size": 1, "dtype": self.dtype, "device": self.device, "max_running_requests": self.engine.max_batch_size,
            "max_total_num_tokens": self.max_context * self.engine.max_batch_size, "weight_version": self.engine.weight_version,
            "version": "mega_async-embedded", "weights_root": str(self.weights_root),
            "num_running_reqs": self.engine.num_running, "num_waiting_reqs": self.engine.num_waiting,
        })

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self._ready else 503)

    async def v1_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_path, "object": "model", "created": 0, "owned_by": "mega_async", "root": self.model_path}]})


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="mega_async embedded inference server (SGLang protocol)")
    p.add_argument("--model", "--model-path", dest="model", required=True, help="HF-format model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--weights-root", default=None, help="weight updates load only from directories under this root "
                   "(default: the model directory's parent)")
    p.add_argument("--api-key", default=os.environ.get("MEGA_ASYNC_API_KEY"))
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice); give each of N servers on one host cores/N")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (Path(args.model) / "config.json").exists():
        raise SystemExit(f"--model {args.model}: no config.json there; pass an HF-format model directory")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    server = EmbeddedServer(args.model, dtype=args.dtype, device=args.device, weights_root=args.weights_root,
                            api_key=args.api_key, max_batch_size=args.max_running_requests, seed=args.random_seed,
                            host=args.host, port=args.port)
    logger.info("serving %s on http://%s:%d", args.model, args.host, args.port)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, handle_signals=True)


if __name__ == "__main__":
    main()
