"""Agent workflow: an agent written against the plain `openai` client runs inside an episode.

Each episode serves its own OpenAI-compatible endpoint on loopback (`<url>/v1/chat/completions`, SGLang's
request and response shapes, including its extensions `prompt_token_ids`, `token_ids`, `meta_info` and
`metadata.weight_version`). A request is turned into token ids here — messages that continue an earlier
completion reuse that completion's exact tokens (prompt + output), and only the new turns go through the
model card's chat template — and generated through the rollout engine (`agenerate`: interruptions,
resubmission and per-token versions as for any episode, against embedded servers or real SGLang). Every
completion is recorded token-in/token-out; chained completions become one trajectory row (model tokens
trained, everything else context), so nothing is ever re-tokenized.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from aiohttp import web

from mega_async.reward import RewardRunner
from mega_async.rollout import chat
from mega_async.rollout.workflow import RolloutWorkflow, Trajectory
from mega_async.algo.batch import concat_padded
from mega_async.api.types import ModelRequest, ModelResponse

logger = logging.getLogger("mega_async.rollout.agent")

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"  # Qwen / Hermes tool-call format
# fields an OpenAI client may send that change nothing here when left at these values
_NEUTRAL = {"model": None, "n": 1, "stream": False, "seed": None, "user": None, "metadata": None, "store": None,
            "frequency_penalty": 0, "presence_penalty": 0, "parallel_tool_calls": None, "tool_choice": None,
            "top_logprobs": None, "logit_bias": None, "stream_options": None}
_USED = {"messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
         "tools", "logprobs", "chat_template_kwargs", "return_token_ids", "return_prompt_token_ids",
         "return_meta_info", "ignore_eos", "skip_special_tokens", "rid", "return_routed_experts"}


class BadRequest(ValueError):
    """A chat request this endpoint cannot serve (answered 400 with SGLang's error shape)."""


@dataclass
class Completion:
    messages: list[dict]
    prompt_ids: list[int]
    response: ModelResponse
    message: dict  # the assistant message returned to the agent


@dataclass
class AgentSession:
    """One episode's endpoint state: the engine it generates with and every completion so far."""

    engine: Any
    completions: list[Completion] = field(default_factory=list)
    error: Optional[BaseException] = None


def _norm(msg: dict) -> tuple:
    """A message as (role, content, tool calls) for matching an agent's history against recorded output."""
    calls = tuple((c.get("function", {}).get("name"), _args(c.get("function", {}).get("arguments")))
                  for c in (msg.get("tool_calls") or []))
    return msg.get("role"), msg.get("content") or "", calls


def _args(a: Any) -> str:
    if isinstance(a, str):
        try:
            return json.dumps(json.loads(a), sort_keys=True)
        except json.JSONDecodeError:
            return a
    return json.dumps(a, sort_keys=True)


def tool_call_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, body) of each `<tool_call>...</tool_call>` block, the body stripped of whitespace: what
    `re.finditer(r"<tool_call>\\s*(.*?)\\s*</tool_call>", text, re.DOTALL)` finds, in one pass of str.find
    (that regex rescanned the rest of the text from every unclosed `<tool_call>`: 88 KB of them took 21 s,
    on the event loop). An opening with no closing after it ends the scan: no later one can close either."""
    spans, pos = [], 0
    while (start := text.find(_OPEN, pos)) != -1:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end == -1:
            break
        spans.append((start, end + len(_CLOSE), text[start + len(_OPEN):end].strip()))
        pos = end + len(_CLOSE)
    return spans


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks out of the text."""
    calls = []
    spans = tool_call_spans(text)
    for i, (_, _, body) in enumerate(spans):
        try:
            obj = json.loads(body)
            name, args = obj["name"], obj.get("arguments", {})
            args = args if isinstance(args, str) else json.dumps(args)
        except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
            continue  # not a well-formed call (or JSON nested past the parser's depth): left in the content
        if not isinstance(name, str):
            continue  # OpenAI's function.name is a string
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "index": i, "type": "function",
                      "function": {"name": name, "arguments": args}})
    if not calls:
        return text, calls
    kept, pos = [], 0
    for start, end, _ in spans:
        kept.append(text[pos:start])
        pos = end
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


class AgentWorkflow(RolloutWorkflow):
    """`agent(client, data)` gets an `openai.AsyncOpenAI` (or, for a plain function, `openai.OpenAI`) client bound
    to this episode and returns a reward (float), or the final answer when `reward_fn` scores it. The episode
    becomes the trajectory of its recorded completions; an agent error or a failed generation fails it."""

    def __init__(self, agent: Callable[..., Any], tokenizer: Any, *, reward_fn: Optional[Callable[..., Any]] = None,
                 max_new_tokens: int = 256, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 max_completions: int = 32, max_context: Optional[int] = None, episode_timeout: float = 600.0,
                 reward_timeout: float = 15.0, host: str = "127.0.0.1", return_routed_experts: bool = False):
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("AgentWorkflow needs the model card's tokenizer with a chat template")
        self.agent, self.tokenizer = agent, tokenizer
        self.reward = RewardRunner(reward_fn, timeout=reward_timeout) if reward_fn is not None else None
        self.sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                             return_routed_experts=return_routed_experts)  # routes for routing replay (R3)
        self.max_completions, self.max_context = max_completions, max_context
        self.episode_timeout, self.host = episode_timeout, host
        stops = [tokenizer.eos_token_id, chat.end_of_turn_id(tokenizer)]
        self.stop_token_ids = sorted({int(s) for s in stops if s is not None})

    # ---- the episode ---------------------------------------------------------------------------
    async def arun_episode(self, engine: Any, data: Any) -> Optional[dict]:
        session = AgentSession(engine)
        runner = web.AppRunner(self._app(session), access_log=None)
        await runner.setup()
        sock = socket.socket()
        try:
            sock.bind((self.host, 0))  # a free port of our own for this episode
            await web.SockSite(runner, sock).start()
        except BaseException:
            sock.close()
            await runner.cleanup()
            raise
        base_url = f"http://{self.host}:{sock.getsockname()[1]}/v1"
        try:
            try:
                result = await asyncio.wait_for(self._run_agent(base_url, data), self.episode_timeout)
            except asyncio.TimeoutError as e:  # asyncio's own has an empty message
                raise TimeoutError(f"agent episode at {base_url} did not finish within episode_timeout="
                                   f"{self.episode_timeout:g}s") from e
        finally:
            await runner.cleanup()
        if session.error is not None:
            raise session.error
        if not session.completions:
            logger.warning("agent finished without a completion; episode rejected")
            return None
        reward = await self._score(result, data)
        return None if reward is None else self.trajectory(session, reward)

    async def _run_agent(self, base_url: str, data: Any) -> Any:
        import openai

        kw = dict(base_url=base_url, api_key="episode", max_retries=0, timeout=self.episode_timeout)
        if inspect.iscoroutinefunction(self.agent):
            async with openai.AsyncOpenAI(**kw) as client:
                return await self.agent(client, data)
        with openai.OpenAI(**kw) as client:  # a plain function runs in a thread: the endpoint stays served
            return await asyncio.to_thread(self.agent, client, data)

    async def _score(self, result: Any, data: dict) -> Optional[float]:
        if self.reward is None:
            if not isinstance(result, (int, float)) or isinstance(result, bool):
                raise TypeError(f"the agent returned {type(result).__name__}; return a float reward or pass reward_fn")
            return float(result)
        item = {k: v for k, v in data.items() if k not in ("prompt", "messages")}
        return await self.reward(str(data.get("prompt", "")), str(result), **item)

    @staticmethod
    def trajectory(session: AgentSession, reward: float) -> dict:
        """Chained completions (one's prompt starts with an earlier prompt + output) share one row."""
        rows: list[Trajectory] = []
        for c in session.completions:
            row = next((r for r in reversed(rows) if c.prompt_ids[:len(r.ids)] == r.ids), None)
            if row is None:
                row = Trajectory(c.prompt_ids)
                rows.append(row)
            else:
                row.add_context(c.prompt_ids[len(row.ids):])
            row.add_output(c.response)
        return concat_padded([r.tensors(reward) for r in rows])

    # ---- the endpoint --------------------------------------------------------------------------
    def _app(self, session: AgentSession) -> web.Application:
        app = web.Application(client_max_size=64 << 20)

        async def completions(request: web.Request) -> web.Response:
            try:
                try:
                    body = await request.json()
                except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, nesting past the parser's depth
                    raise BadRequest(f"invalid JSON body: {type(e).__name__}: {e}") from None
                return web.json_response(await self.complete(session, body))
            except BadRequest as e:
                return _error(400, str(e))
            except Exception as e:  # noqa: BLE001 - a generation failure fails the episode after the agent returns
                session.error = session.error or e
                logger.warning("agent completion failed: %s: %s", type(e).__name__, e)
                return _error(500, f"{type(e).__name__}: {e}")

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "default", "object": "model",
                                                                  "owned_by": "mega_async"}]})

        app.router.add_post("/v1/chat/completions", completions)
        app.router.add_get("/v1/models", models)
        return app

    def prompt_for(self, session: AgentSession, messages: list[dict], **tpl: Any) -> list[int]:
        """Token ids of a request: the newest recorded completion that the messages continue, plus the new turns."""
        norm = [_norm(m) for m in messages]
        for c in reversed(session.completions):
            k = len(c.messages)
            if len(norm) > k + 1 and norm[:k] == [_norm(m) for m in c.messages] and norm[k] == _norm(c.message):
                out = list(c.response.output_tokens)
                return (list(c.prompt_ids) + out + chat.close_ids(self.tokenizer, out, **tpl)
                        + chat.turn_ids(self.tokenizer, messages[k + 1:], **tpl))
        return chat.prompt_ids(self.tokenizer, messages, **tpl)

    async def complete(self, session: AgentSession, body: dict) -> dict:
        """Serve one /v1/chat/completions request (SGLang's response shape)."""
        req, messages, tpl = self._request(session, body)
        resp = await session.engine.agenerate(req)
        text = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=body.get("skip_special_tokens", True))
        content, calls = parse_tool_calls(text) if body.get("tools") else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        session.completions.append(Completion(messages, list(req.input_ids), resp, message))
        finish = "tool_calls" if calls else resp.stop_reason
        version = str(resp.output_versions[-1]) if resp.output_versions else None
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish,
                                  "matched_stop": resp.output_tokens[-1] if resp.stop_reason == "stop" else None}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [self._logprob(t, lp) for t, lp in
                                              zip(resp.output_tokens, resp.output_logprobs)]}
        if body.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = list(req.input_ids)
        if body.get("return_token_ids"):
            choice["token_ids"] = list(resp.output_tokens)
        n_in, n_out = len(req.input_ids), len(resp.output_tokens)
        if body.get("return_meta_info"):  # SGLang's native meta_info keys (+ num_interruptions)
            spans = version_spans(resp.output_versions)
            choice["meta_info"] = {
                "id": req.rid, "finish_reason": {"type": resp.stop_reason, "matched": choice["matched_stop"]},
                "prompt_tokens": n_in, "completion_tokens": n_out,
                "weight_version": spans[-1]["version"] if spans else version, "weight_versions": spans,
                "output_token_logprobs": [[lp, t, None] for t, lp in zip(resp.output_tokens, resp.output_logprobs)],
                "num_interruptions": resp.num_interruptions}
        return {"id": f"chatcmpl-{req.rid}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or "default", "choices": [choice],
                "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
                "metadata": {"weight_version": version}}

    def _request(self, session: AgentSession, body: dict) -> tuple[ModelRequest, list[dict], dict]:
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            raise BadRequest("messages: a non-empty list of chat messages is required")
        unknown = sorted(k for k in body if k not in _USED and k not in _NEUTRAL)
        off = sorted(k for k, v in body.items() if k in _NEUTRAL and v != _NEUTRAL[k] and k != "model"
                     and not (k == "tool_choice" and v in ("auto", "none")))
        if unknown or off:
            raise BadRequest(f"unsupported field(s) {', '.join(unknown + off)}: this endpoint serves n=1, "
                             "non-streaming chat completions (stop strings: use stop_token_ids)")
        if len(session.completions) >= self.max_completions:
            raise BadRequest(f"the episode used its {self.max_completions} completions (max_completions)")
        tpl = body.get("chat_template_kwargs") or {}
        if not isinstance(tpl, dict) or "chat_template" in tpl:  # episodes are rendered with the model card's
            raise BadRequest("chat_template_kwargs must be an object without chat_template (episodes use the "
                             "model card's chat template)")
        tpl = dict(tpl)
        if body.get("tools"):
            tpl["tools"] = body["tools"]
        messages = body["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise BadRequest("messages: every message needs a role")
        ids = self.prompt_for(session, messages, **tpl)
        cap = self.sampling["max_new_tokens"]
        try:
            n = min(int(body.get("max_completion_tokens") or body.get("max_tokens") or cap), cap)
            extra_stops = {int(s) for s in body.get("stop_token_ids") or []}
        except (TypeError, ValueError):
            raise BadRequest("max_tokens, max_completion_tokens and stop_token_ids take integers") from None
        if n < 1:
            raise BadRequest(f"max_tokens={n} must be >= 1")
        if self.max_context is not None and len(ids) + n > self.max_context:
            raise BadRequest(f"{len(ids)} prompt tokens + max_tokens {n} exceed the model's context {self.max_context}")
        sampling = {k: body[k] if body.get(k) is not None else v for k, v in self.sampling.items()
                    if k != "max_new_tokens"}
        routes = self.sampling["return_routed_experts"] or body.get("return_routed_experts")
        sampling["return_routed_experts"] = bool(routes)
        stops = sorted(set(self.stop_token_ids) | extra_stops)
        req = ModelRequest(input_ids=ids, max_new_tokens=n, stop_token_ids=stops,
                           ignore_eos=bool(body.get("ignore_eos", False)), **sampling)
        if body.get("rid"):
            req.rid = str(body["rid"])
        return req, messages, tpl

    def _logprob(self, token: int, lp: float) -> dict:
        s = self.tokenizer.decode([token], skip_special_tokens=False)
        return {"token": s, "bytes": list(s.encode()), "logprob": lp, "top_logprobs": []}


def version_spans(versions: list[int]) -> list[dict]:
    """SGLang's meta_info.weight_versions: [{version, start, end}] runs over the output tokens."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def _error(code: int, message: str) -> web.Response:
    """SGLang's ErrorResponse body."""
    return web.json_response({"object": "error", "message": message,
                              "type": "BadRequestError" if code == 400 else "InternalServerError",
                              "param": None, "code": code}, status=code)
