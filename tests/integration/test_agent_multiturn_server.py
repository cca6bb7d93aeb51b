"""Agent and multi-turn episodes against the embedded server: every trained token's logprob is the one the
serving weights give it in the final sequence (token-in/token-out), through a weight update mid-episode."""
import asyncio

import openai
import pytest
import torch
from transformers import AutoTokenizer

from mega_async.inference.client import SGLangClient
from mega_async.rollout.agent import AgentWorkflow
from mega_async.rollout.workflow import MultiTurnWorkflow
from mega_async.trainer.sync import reload_sync, RolloutSide
from mega_async.api.types import WeightVersion

from .conftest import post, ref_logprobs, run

CARD = "models/tiny-qwen3-moe"
pytestmark = pytest.mark.slow  # a server start and ~40 s of CPU generation


def check_against(hf_models, t, temperature):
    """Each trained token's logprob equals the logprob under the weights of its version, given its prefix."""
    seq, mask, vers, lps = (t["input_ids"][0].tolist(), t["loss_mask"][0].bool(), t["versions"][0], t["logprobs"][0])
    for v in sorted(set(vers[mask].tolist())):
        ref = ref_logprobs(hf_models[f"v{v}"], seq[:1], seq[1:], temperature)  # logprob of tokens 1..L-1
        sel = (mask & (vers == v))[1:]
        assert torch.allclose(lps[1:][sel], ref[sel], atol=2e-4), f"version {v} logprobs differ"


def test_multi_turn_against_the_server(server, hf_models):
    tok = AutoTokenizer.from_pretrained(CARD)
    client = SGLangClient(server.addresses)
    wf = MultiTurnWorkflow(lambda p, c, **_: 0.0, tok, max_turns=3, max_new_tokens=12, temperature=0.8)
    t = run(wf.arun_episode(client, {"messages": [{"role": "user", "content": "What is 2 + 2?"}]}))
    mask = t["loss_mask"][0]
    assert t["rewards"].tolist() == [0.0] and int(mask.sum()) > 3
    assert int((mask[1:] - mask[:-1] == 1).sum()) == 3  # three separate model turns
    check_against(hf_models, t, 0.8)


def test_agent_against_the_server_through_a_weight_update(server, hf_models, weights_root):
    tok = AutoTokenizer.from_pretrained(CARD)
    version = WeightVersion()
    client = SGLangClient(server.addresses, version=version.view())
    sync = reload_sync(version, RolloutSide(client), str(weights_root / "v1"))
    started = asyncio.Event()

    async def agent(oai: openai.AsyncOpenAI, data):
        messages = [{"role": "user", "content": data["prompt"]}]
        r = await oai.chat.completions.create(model="default", messages=messages, max_tokens=16)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
        started.set()
        r = await oai.chat.completions.create(model="default", messages=messages, max_tokens=1200,
                                              extra_body={"ignore_eos": True, "return_meta_info": True})
        return float(r.choices[0].model_extra["meta_info"]["num_interruptions"] >= 1)

    async def main():
        wf = AgentWorkflow(agent, tok, max_new_tokens=1200, temperature=1.0)
        task = asyncio.create_task(wf.arun_episode(client, {"prompt": "Tell me a story."}))
        await started.wait()
        await asyncio.sleep(0.5)

        try:  # the sync's pause bracket around loading v1 (version 1)
            await asyncio.to_thread(sync.push)
        finally:
            sync.close()
        return await task

    try:
        t = run(main())
    finally:
        assert post(server.addresses[0], "/update_weights_from_disk",
                    {"model_path": str(weights_root / "v0"), "weight_version": "0"})[0] == 200
    assert t["input_ids"].shape[0] == 1 and t["rewards"].tolist() == [1.0]  # one row; the 2nd call was interrupted
    vers = t["versions"][0][t["loss_mask"][0].bool()]
    assert set(vers.tolist()) == {0, 1}
    check_against(hf_models, t, 1.0)


def test_one_agent_on_the_servers_openai_endpoint_and_inside_an_episode(server):
    """The same plain-openai agent runs against the embedded server's /v1/chat/completions and inside an episode:
    same prompt tokens, same greedy output, SGLang's meta_info keys on both."""
    tok = AutoTokenizer.from_pretrained(CARD)

    async def agent(oai, data):
        r = await oai.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12, temperature=0.0,
            extra_body={"return_prompt_token_ids": True, "return_meta_info": True})
        data["choice"] = {**r.choices[0].model_extra, "content": r.choices[0].message.content}
        return 1.0

    async def direct():
        async with openai.AsyncOpenAI(base_url=f"http://{server.addresses[0]}/v1", api_key="none") as oai:
            data: dict = {}
            await agent(oai, data)
            return data["choice"]

    on_server = run(direct())
    inside: dict = {}
    t = run(AgentWorkflow(agent, tok, max_new_tokens=12).arun_episode(SGLangClient(server.addresses), inside))
    mine = inside["choice"]
    assert mine["prompt_token_ids"] == on_server["prompt_token_ids"]
    ids_mine = [e[1] for e in mine["meta_info"]["output_token_logprobs"]]
    ids_server = [e[1] for e in on_server["meta_info"]["output_token_logprobs"]]
    n = min(len(ids_mine), len(ids_server))  # the episode also stops at the template's end of turn
    assert n >= 1 and ids_mine[:n] == ids_server[:n]
    keys = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version", "weight_versions",
            "output_token_logprobs"}
    assert keys <= set(on_server["meta_info"]) and keys <= set(mine["meta_info"])
    assert t["input_ids"][0].tolist()[:len(mine["prompt_token_ids"])] == mine["prompt_token_ids"]
