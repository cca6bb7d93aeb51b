"""OpenAI-compatible /v1/completions, /v1/chat/completions and /v1/models, as SGLang serves them.

Each request becomes /generate requests on the same engine (so pauses, weight versions and the prefix
cache apply). SGLang's extensions are honoured: `return_token_ids` (completions: choices[].token_ids and
prompt_token_ids; chat: choices[].prompt_token_ids and response_token_ids), `return_meta_info` (chat:
choices[].meta_info, the native meta_info with output_token_logprobs and weight_versions), top_k, min_p,
min_tokens, repetition_penalty, stop_token_ids, ignore_eos, no_stop_trim, return_routed_experts
(sglext.routed_experts), and `metadata.weight_version(s)` on every response.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from http import HTTPStatus
from typing import Any, Optional

from aiohttp import web

from mega_async.server.detokenize import StreamedText
from mega_async.server.generate_protocol import check_text, output_text
from mega_async.server.protocol import BadRequest, BodyUnparsable, clean, error_body, validate_openai

EmbeddedServer = Any  # app.py's EmbeddedServer (app.py imports this module)
Tracked = Any  # app.py's Tracked (app.py imports this module)

UNSUPPORTED = {"tools": "tool calling", "functions": "function calling", "suffix": "suffix", "echo": "echo",
               "response_format": "response_format", "regex": "regex", "json_schema": "json_schema", "ebnf": "ebnf",
               "audio": "audio output", "prediction": "predicted outputs"}
PASSTHROUGH = ("top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "skip_special_tokens",
               "no_stop_trim", "frequency_penalty", "presence_penalty", "temperature", "top_p", "n", "stop")


class OpenAIError(BadRequest):
    pass


def error_response(msg: str, status: int = 400) -> web.Response:
    return web.json_response({"object": "error", "message": msg, "type": "BadRequestError", "param": None,
                              "code": status}, status=status)


class OpenAIEndpoints:
    def __init__(self, server: "EmbeddedServer") -> None:
        self.s = server

    def register(self, r: web.UrlDispatcher) -> None:
        r.add_get("/v1/models", self.models)
        r.add_get("/v1/models/{model:.+}", self.retrieve_model)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)

    def model_card(self, model_id: str) -> dict:
        """SGLang's ModelCard."""
        return {"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "sglang",
                "root": model_id, "parent": None, "max_model_len": self.s.max_context}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self.model_card(self.s.served_model_name)]})

    async def retrieve_model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{model} (the openai client's models.retrieve): the served model's card, else SGLang's 404."""
        model = request.match_info["model"]
        if model != self.s.served_model_name:
            return web.json_response({"error": {"message": f"The model '{model}' does not exist",
                                                "type": "invalid_request_error", "param": "model",
                                                "code": "model_not_found"}}, status=404)
        return web.json_response(self.model_card(model))

    # ---- request mapping ---------------------------------------------------------------------
    def _generate_body(self, req: dict, prompts: list[list[int]], chat: bool) -> dict:
        for k, what in UNSUPPORTED.items():
            v = req.get(k)
            if v not in (None, False, [], {}, "") and not (k == "response_format" and v == {"type": "text"}):
                raise OpenAIError(f"{k}: {what} is not supported by the embedded server")
        if req.get("best_of") is not None and req["best_of"] != (req.get("n") or 1):
            raise OpenAIError("best_of different from n is not supported by the embedded server")
        sp = {k: req[k] for k in PASSTHROUGH if req.get(k) is not None}
        max_tokens = req.get("max_completion_tokens") if chat else None
        max_tokens = req.get("max_tokens") if max_tokens is None else max_tokens
        if max_tokens is None:
            max_tokens = max(0, self.s.max_context - max(len(p) for p in prompts)) if chat else 16
        sp["max_new_tokens"] = max_tokens
        if req.get("min_tokens") is not None:
            sp["min_new_tokens"] = req["min_tokens"]
        if req.get("seed") is not None:
            sp["sampling_seed"] = req["seed"]
        if req.get("logit_bias"):
            sp["logit_bias"] = req["logit_bias"]
        if req.get("custom_params") is not None:  # SGLang's extension, passed through to sampling_params
            sp["custom_params"] = req["custom_params"]
        if chat:
            want_lp, top = bool(req.get("logprobs")), req.get("top_logprobs") or 0
        else:
            want_lp, top = req.get("logprobs") is not None, req.get("logprobs") or 0
        body = {"input_ids": prompts if len(prompts) > 1 else prompts[0], "sampling_params": sp,
                "return_logprob": want_lp or bool(req.get("return_meta_info")), "top_logprobs_num": top,
                "return_routed_experts": bool(req.get("return_routed_experts"))}
        if req.get("rid") is not None:
            body["rid"] = req["rid"]
        if req.get("custom_logit_processor") is not None:  # refused as /generate refuses it
            body["custom_logit_processor"] = req["custom_logit_processor"]
        return body

    async def _chat_prompt(self, req: dict) -> list[int]:
        tok = self.s.tokenizer
        msgs = req.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise OpenAIError("messages must be a non-empty list of {role, content} objects")
        if tok is None or not getattr(tok, "chat_template", None):
            raise OpenAIError("the model card has no chat template (chat_template.jinja): use /v1/completions")
        kwargs = req.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise OpenAIError("chat_template_kwargs must be an object")
        if "chat_template" in kwargs:  # a client's Jinja template would run here, unbounded (SGLang 0.5.21+ refuses)
            raise OpenAIError("Request-supplied chat_template is not allowed: the embedded server renders the "
                              "model card's chat template only")
        loop = asyncio.get_running_loop()

        def render() -> list[int]:
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
            check_text(text, self.s.limits)  # as /generate: surely longer than the context is not tokenized
            return tok(text, add_special_tokens=False)["input_ids"]

        return await loop.run_in_executor(None, render)

    async def _completion_prompts(self, req: dict) -> list[list[int]]:
        p = req.get("prompt")
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            items = [p]
        elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            items = list(p)
        else:
            raise OpenAIError("prompt must be a string, a list of strings, or token ids")
        return await self.s.tokenize(items)

    # ---- endpoints ---------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            req = validate_openai(request.path, await self.s._dict_body(request))
            prompts = [await self._chat_prompt(req)] if chat else await self._completion_prompts(req)
            body = self._generate_body(req, prompts, chat)
            reqs, _ = await self.s.prepare(body)
        except BodyUnparsable as e:  # FastAPI's HTTPException in SGLang: its ErrorResponse, type "400"
            return web.json_response(error_body(e), status=400)
        except BadRequest as e:
            return error_response(str(e))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        model = req.get("model") or self.s.served_model_name
        if req.get("stream"):
            if chat and (req.get("return_token_ids") or req.get("return_meta_info")):
                return error_response("return_token_ids / return_meta_info are not supported with streaming; "
                                      "set stream=false")
            return await self._stream(request, req, reqs, rid, model, chat)
        try:
            tracked = await self.s.run_all(reqs, body_fn=lambda t: t)
        except BadRequest as e:
            return error_response(str(e))
        choices = [self._choice(i, t, req, chat) for i, t in enumerate(tracked)]
        native = [self.s.body(t) for t in tracked]
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
               "model": model, "choices": choices, "usage": usage(tracked, n=(req.get("n") or 1)),
               "metadata": weight_metadata(native[0]["meta_info"])}
        routes = next((m["meta_info"].get("routed_experts") for m in native if m["meta_info"].get("routed_experts")),
                      None)
        if routes is not None:
            out["sglext"] = {"routed_experts": routes}
        return web.json_response(clean(out))

    def _choice(self, i: int, t: "Tracked", req: dict, chat: bool) -> dict:
        r, fr = t.req, t.req.finish_reason or {}
        text = output_text(r, t.opts, self.s.tokenizer)
        c: dict[str, Any] = {"index": i, "finish_reason": fr.get("type"), "matched_stop": fr.get("matched")}
        if chat:
            c["message"] = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}
            c["logprobs"] = self._chat_logprobs(r, r.output_ids, r.output_logprobs, r.output_top_logprobs) \
                if req.get("logprobs") else None
            if req.get("return_token_ids") or req.get("return_prompt_token_ids"):
                c["prompt_token_ids"] = list(r.input_ids)
            if req.get("return_token_ids"):
                c["response_token_ids"] = list(r.output_ids)
            if req.get("return_meta_info"):
                c["meta_info"] = self.s.body(t)["meta_info"]
        else:
            c["text"] = text
            c["logprobs"] = self._completion_logprobs(r, r.output_ids, r.output_logprobs, r.output_top_logprobs) \
                if req.get("logprobs") is not None else None
            if req.get("return_token_ids"):
                c["token_ids"], c["prompt_token_ids"] = list(r.output_ids), list(r.input_ids)
        return c

    def _tok(self, t: int) -> str:
        return self.s.tokenizer.decode([t]) if self.s.tokenizer is not None else str(t)

    def _chat_logprobs(self, r: Any, ids: list[int], lps: list[float], tops: list) -> dict:
        content = []
        for k, (t, lp) in enumerate(zip(ids, lps)):
            s = self._tok(t)
            top = [{"token": self._tok(tt), "bytes": list(self._tok(tt).encode()), "logprob": tl}
                   for tl, tt in (tops[k] if k < len(tops) else [])]
            content.append({"token": s, "bytes": list(s.encode()), "logprob": lp, "top_logprobs": top})
        return {"content": content}

    def _completion_logprobs(self, r: Any, ids: list[int], lps: list[float], tops: list) -> dict:
        toks = [self._tok(t) for t in ids]
        offsets, pos = [], 0
        for s in toks:
            offsets.append(pos)
            pos += len(s)
        top = [{self._tok(tt): tl for tl, tt in row} for row in tops] if tops else [None] * len(ids)
        return {"text_offset": offsets, "token_logprobs": list(lps), "tokens": toks, "top_logprobs": top}

    # ---- streaming ---------------------------------------------------------------------------
    async def _stream(self, request: web.Request, req: dict, reqs: list, rid: str, model: str,
                      chat: bool) -> web.StreamResponse:
        obj = "chat.completion.chunk" if chat else "text_completion"
        async with self.s.streaming(request, reqs) as (resp, tracked):

            async def send(choice: dict, usage_: Optional[dict] = None) -> None:
                chunk = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
                         "choices": [choice] if choice else [], "usage": usage_}
                await resp.write(b"data: " + json.dumps(clean(chunk)).encode() + b"\n\n")

            sent_tok = [0] * len(tracked)
            tok = self.s.tokenizer
            texts = [StreamedText(tok, t.opts.skip_special_tokens, t.opts.spaces_between_special_tokens, t.req.stop)
                     if tok is not None else None for t in tracked]
            if chat:
                for i in range(len(tracked)):
                    await send({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None})
            going = True
            while going:
                for i, t in enumerate(tracked):
                    going = going and await self._stream_delta(send, resp, i, t, req, chat, sent_tok, texts)
                if all(t.done.done() and sent_tok[i] < 0 for i, t in enumerate(tracked)):
                    break
                if going:
                    await self.s.next_change(tracked)
            if (req.get("stream_options") or {}).get("include_usage"):
                await send({}, usage(tracked, n=(req.get("n") or 1)))
            await resp.write(b"data: [DONE]\n\n")
        return resp

    def _held_stop_token(self, r: Any, n: int) -> bool:
        """The newest token may be the stop token the finished text drops: a running stream waits for it."""
        t = r.output_ids[n - 1] if n else None
        return t is not None and not r.ignore_eos and (t in r.stop_token_ids or t in self.s.engine.eos_ids)

    async def _stream_delta(self, send: Any, resp: web.StreamResponse, i: int, t: "Tracked", req: dict, chat: bool,
                            sent_tok: list, texts: list) -> bool:
        """Send choice i's new text and tokens, if any. The text is decoded incrementally (each token a bounded
        number of times, detokenize.py), and what was sent concatenates to the non-streaming text. False: the
        stream ends (SGLang's error chunk for an abort with a status code, e.g. the queue being full)."""
        if sent_tok[i] < 0:
            return True
        t.changed.clear()
        fin = t.done.done()
        r = t.req
        n = len(r.output_ids)
        if n == sent_tok[i] and not fin:
            return True
        fr = (r.finish_reason or {}) if fin else {}
        if fr.get("type") == "abort" and fr.get("status_code"):
            code = int(fr["status_code"])
            err = {"object": "error", "message": fr.get("message") or "Generation aborted.",
                   "type": HTTPStatus(code).name, "param": None, "code": code}
            await resp.write(b"data: " + json.dumps({"error": err}).encode() + b"\n\n")
            sent_tok[i] = -1
            return False
        st = texts[i]
        if st is None:
            delta = ""
        elif fin:
            delta = st.final(output_text(r, t.opts, self.s.tokenizer))
        else:
            delta = st.delta(r.output_ids, n - 1 if self._held_stop_token(r, n) else n)
            if not delta:
                return True  # an incomplete character or a possible stop string: its tokens go with the next text
        ids, lps = r.output_ids[sent_tok[i]:n], r.output_logprobs[sent_tok[i]:n]
        tops = r.output_top_logprobs[sent_tok[i]:n]
        choice: dict[str, Any] = {"index": i, "finish_reason": fr.get("type"), "matched_stop": fr.get("matched")}
        if chat:
            choice["delta"] = {"content": delta}
            choice["logprobs"] = self._chat_logprobs(r, ids, lps, tops) if req.get("logprobs") else None
        else:
            choice["text"] = delta
            choice["logprobs"] = self._completion_logprobs(r, ids, lps, tops) if req.get("logprobs") is not None \
                else None
            if req.get("return_token_ids"):
                choice["token_ids"] = list(ids)
        await send(choice)
        sent_tok[i] = -1 if fin else n
        return True


def usage(tracked: list, n: int = 1) -> dict:
    """OpenAI usage; prompt and cached tokens count once per prompt (stride n), as SGLang's UsageProcessor."""
    prompt = sum(len(t.req.input_ids) for t in tracked[::n])
    cached = sum(t.req.cached_tokens for t in tracked[::n])
    completion = sum(len(t.req.output_ids) for t in tracked)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}, "reasoning_tokens": 0}


def weight_metadata(meta: dict) -> dict:
    """SGLang's build_endpoint_weight_version_metadata."""
    return {"weight_version": meta["weight_version"], "weight_versions": meta.get("weight_versions", [])}
