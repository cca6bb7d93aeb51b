"""The official `openai` client against the embedded server as its base_url, and routed experts (MoE replay)."""
import base64

import numpy as np
import pytest
import torch

from mega_async.inference.servers import ServerLauncher, ServerSpec

from .conftest import post, ref_logprobs

pytestmark = pytest.mark.slow  # starts servers or trainer ranks: CI's second step keeps the default suite under 20 minutes on 2 cores


@pytest.fixture(scope="module")
def routed_server(weights_root, tmp_path_factory):
    spec = ServerSpec("embedded", str(weights_root / "v0"), num_servers=1, weights_root=str(weights_root),
                      extra_args=["--enable-return-routed-experts", "--served-model-name", "tiny"])
    with ServerLauncher(spec, log_dir=str(tmp_path_factory.mktemp("logs")), startup_timeout=120) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def client(routed_server):
    from openai import OpenAI

    return OpenAI(base_url=f"http://{routed_server.addresses[0]}/v1", api_key="none", max_retries=0)


def test_chat_completion_returns_text_ids_logprobs_usage(client, hf_models):
    from transformers import AutoTokenizer

    msgs = [{"role": "user", "content": "Natalia sold clips to 48 friends."}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0.7, logprobs=True,
                                       top_logprobs=2, extra_body={"return_token_ids": True, "ignore_eos": True})
    c = r.choices[0]
    extra = c.model_extra
    tok = AutoTokenizer.from_pretrained(str(hf_models["v0"].name_or_path))
    prompt = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    assert extra["prompt_token_ids"] == prompt and len(extra["response_token_ids"]) == 8
    assert c.finish_reason == "length" and isinstance(c.message.content, str)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 8
    lps = torch.tensor([x.logprob for x in c.logprobs.content])
    ref = ref_logprobs(hf_models["v0"], prompt, extra["response_token_ids"], 0.7)
    assert torch.allclose(lps, ref, atol=1e-4) and all(len(x.top_logprobs) == 2 for x in c.logprobs.content)
    assert r.to_dict()["metadata"]["weight_version"] == "0"


def test_chat_stream_and_completions(client):
    msgs = [{"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    comp = client.completions.create(model="tiny", prompt=[5, 17, 300, 42], max_tokens=5, temperature=0, logprobs=2,
                                     n=2, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert len(comp.choices) == 2 and comp.usage.prompt_tokens == 4 and comp.usage.completion_tokens == 10
    assert len(comp.choices[0].logprobs.token_logprobs) == 5 and comp.choices[0].model_extra["token_ids"]
    # counted once per prompt (the first sample), which, as in SGLang, joins from the prompt's warm-up prefill
    assert comp.usage.prompt_tokens_details.cached_tokens == 3
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="tool calling is not supported"):
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2,
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])


def test_routed_experts_are_the_routers_top_k(routed_server, hf_models):
    """meta_info.routed_experts: base64 int32 [prompt + output - 1, layers, top_k] equal to the top-k of each
    layer's router logits in a transformers forward of the same tokens."""
    addr = routed_server.addresses[0]
    prompt = [5, 17, 300, 42, 7]
    st, out = post(addr, "/generate", {"input_ids": prompt, "return_routed_experts": True,
                                       "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert st == 200, out
    cfg = hf_models["v0"].config
    seq = prompt + out["output_ids"]
    routes = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    routes = routes.reshape(len(seq) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    with torch.no_grad():
        res = hf_models["v0"](torch.tensor([seq[:-1]]), output_router_logits=True)
    ref = torch.stack([lg.float().softmax(-1).topk(cfg.num_experts_per_tok, -1).indices for lg in res.router_logits], 1)
    assert np.array_equal(np.sort(routes, -1), np.sort(ref.numpy(), -1))
