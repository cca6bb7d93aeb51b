"""Agent workflow: agents on the plain openai client, recorded token-in/token-out into one trajectory."""
import asyncio
import json

import openai
import pytest
from transformers import AutoTokenizer

from mega_async.rollout import chat
from mega_async.rollout.agent import AgentWorkflow, parse_tool_calls
from mega_async.api.types import ModelRequest, ModelResponse

CARD = "models/tiny-qwen3-moe"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(CARD)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """Answers request k with the token ids of texts[k] (+ <|im_end|>), logprob -0.25, versions from the script."""

    def __init__(self, tok, texts, versions=None):
        self.tok, self.texts, self.versions, self.requests = tok, texts, versions or {}, []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        k = len(self.requests)
        self.requests.append(req)
        out = ids(self.tok, self.texts[k]) + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        vs = self.versions.get(k, [0] * len(out))
        return ModelResponse(list(req.input_ids), out, [-0.25] * len(out), vs, "stop")


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


async def tool_agent(client: openai.AsyncOpenAI, data: dict) -> float:
    """A plain OpenAI tool-calling loop: call the tool the model asks for, then read the final answer."""
    messages = [{"role": "user", "content": data["question"]}]
    for _ in range(4):
        r = await client.chat.completions.create(model="default", messages=messages, tools=TOOLS)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return 1.0 if msg.content.strip() == data["answer"] else 0.0
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    return 0.0


def test_tool_calling_agent_becomes_one_trajectory_without_retokenizing(tok):
    n_call = len(ids(tok, CALL)) + 1
    eng = ScriptedEngine(tok, [CALL, "5"], versions={0: [0] * (n_call - 2) + [1, 1]})  # turn 1 interrupted
    wf = AgentWorkflow(tool_agent, tok, max_new_tokens=64)
    t = asyncio.run(wf.arun_episode(eng, {"question": "2 + 3?", "answer": "5"}))
    assert t["rewards"].tolist() == [1.0] and t["input_ids"].shape[0] == 1
    r0, r1 = eng.requests
    first_out = ids(tok, CALL) + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert r0.input_ids == chat.prompt_ids(tok, [{"role": "user", "content": "2 + 3?"}])
    # token in, token out: the second prompt continues the first prompt and output token for token
    assert r1.input_ids[:len(r0.input_ids) + n_call] == r0.input_ids + first_out
    tail = r1.input_ids[len(r0.input_ids) + n_call:]
    assert tok.decode(tail) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    seq = t["input_ids"][0].tolist()
    assert seq == r1.input_ids + ids(tok, "5") + [tok.convert_tokens_to_ids("<|im_end|>")]
    mask, vers = t["loss_mask"][0].tolist(), t["versions"][0].tolist()
    trained = [i for i, m in enumerate(mask) if m]
    assert trained == list(range(len(r0.input_ids), len(r0.input_ids) + n_call)) + \
        list(range(len(r1.input_ids), len(seq)))
    assert [vers[i] for i in trained] == [0] * (n_call - 2) + [1, 1] + [0, 0]
    assert all(abs(t["logprobs"][0, i].item() + 0.25) < 1e-6 for i in trained)
    assert eng.requests[0].stop_token_ids == sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")})


def test_sync_agent_and_sglang_response_fields(tok):
    seen = {}

    def agent(client: openai.OpenAI, data):
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                           max_tokens=8, temperature=0.0,
                                           extra_body={"return_token_ids": True, "return_prompt_token_ids": True,
                                                       "return_meta_info": True})
        seen.update(r.model_dump())
        return r.choices[0].message.content

    eng = ScriptedEngine(tok, ["hello"], versions={0: [3] * (len(ids(tok, "hello")) + 1)})
    wf = AgentWorkflow(agent, tok, reward_fn=lambda p, c, **_: float(c == "hello"), max_new_tokens=16)
    t = asyncio.run(wf.arun_episode(eng, {"prompt": "hi"}))
    assert t["rewards"].tolist() == [1.0]
    ch = seen["choices"][0]
    assert ch["token_ids"] == ids(tok, "hello") + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert ch["prompt_token_ids"] == eng.requests[0].input_ids and ch["finish_reason"] == "stop"
    assert [x["logprob"] for x in ch["logprobs"]["content"]] == [-0.25] * len(ch["token_ids"])
    meta = ch["meta_info"]
    assert meta["weight_versions"] == [{"version": "3", "start": 0, "end": len(ch["token_ids"])}]
    assert meta["weight_version"] == seen["metadata"]["weight_version"] == "3"
    assert [e[1] for e in meta["output_token_logprobs"]] == ch["token_ids"]
    assert meta["finish_reason"]["type"] == "stop" and meta["prompt_tokens"] == len(ch["prompt_token_ids"])
    assert seen["usage"]["completion_tokens"] == len(ch["token_ids"])
    req = eng.requests[0]
    assert (req.max_new_tokens, req.temperature) == (8, 0.0)


def test_unsupported_requests_fail_loudly_and_engine_errors_fail_the_episode(tok):
    async def agent(client, data):
        with pytest.raises(openai.BadRequestError, match="stream"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
        with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stop=["."])
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return float(r.choices[0].message.content == "ok")

    eng = ScriptedEngine(tok, ["ok"])
    assert asyncio.run(AgentWorkflow(agent, tok).arun_episode(eng, {}))["rewards"].tolist() == [1.0]

    class Broken:
        async def agenerate(self, req):
            raise ConnectionError("no server")

    async def swallowing(client, data):
        try:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        except openai.APIError:
            pass
        return 1.0

    with pytest.raises(ConnectionError, match="no server"):
        asyncio.run(AgentWorkflow(swallowing, tok).arun_episode(Broken(), {}))

    async def silent(client, data):
        return 1.0

    assert asyncio.run(AgentWorkflow(silent, tok).arun_episode(eng, {})) is None  # no completion: rejected
    with pytest.raises(ValueError, match="chat template"):
        AgentWorkflow(silent, None)


def test_malformed_request_bodies_answer_400_and_the_episode_goes_on(tok):
    import aiohttp

    async def agent(client, data):
        url = f"{client.base_url}chat/completions"
        msgs = [{"role": "user", "content": "x"}]
        async with aiohttp.ClientSession() as http:
            for body in ("[" * 100_000, json.dumps({"messages": msgs, "max_tokens": "many"}),
                         json.dumps({"messages": msgs, "stop_token_ids": [None]}),
                         json.dumps({"messages": msgs, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}})):
                async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                    assert resp.status == 400, await resp.text()
                    assert (await resp.json())["type"] == "BadRequestError"
        r = await client.chat.completions.create(model="m", messages=msgs)
        return float(r.choices[0].message.content == "ok")

    eng = ScriptedEngine(tok, ["ok"])
    assert asyncio.run(AgentWorkflow(agent, tok).arun_episode(eng, {}))["rewards"].tolist() == [1.0]


def test_rewritten_history_starts_a_new_row(tok):
    async def agent(client, data):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}])
        return 0.5

    eng = ScriptedEngine(tok, ["x", "y"])
    t = asyncio.run(AgentWorkflow(agent, tok).arun_episode(eng, {}))
    assert t["input_ids"].shape[0] == 2 and t["rewards"].tolist() == [0.5, 0.5]


def test_parse_tool_calls():
    content, calls = parse_tool_calls(f"Let me add. {CALL}")
    assert content == "Let me add." and calls[0]["function"]["name"] == "add"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
