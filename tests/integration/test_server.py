"""The embedded server against its protocol, with the real client; references are plain transformers forwards."""
import asyncio
import multiprocessing as mp
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from mega_async.inference.client import SGLangClient
from mega_async.utils.comm import free_port
from mega_async.trainer.sync import reload_sync, RolloutSide
from mega_async.api.types import ModelRequest, ModelResponse, WeightVersion

from .conftest import get, greedy_ok, post, ref_logprobs, run, wait_decoding

PROMPT = [5, 17, 300, 42, 7, 99]


def gen(address, **kw):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0.7}, "return_logprob": True}
    body.update(kw)
    return post(address, "/generate", body)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_match_transformers(server, hf_models, temperature):
    addr = server.addresses[0]
    st, out = gen(addr, sampling_params={"max_new_tokens": 32, "temperature": temperature, "ignore_eos": True})
    assert st == 200, out
    toks = out["output_ids"]
    lps = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    assert [x[1] for x in out["meta_info"]["output_token_logprobs"]] == toks
    ref = ref_logprobs(hf_models["v0"], PROMPT, toks, temperature)
    assert torch.allclose(lps, ref, atol=1e-4), (lps - ref).abs().max()
    m = out["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 32}
    assert (m["prompt_tokens"], m["completion_tokens"], m["weight_version"]) == (len(PROMPT), 32, "0")


def test_greedy_is_deterministic_and_argmax(server, hf_models):
    addr = server.addresses[0]
    outs = [gen(addr, sampling_params={"max_new_tokens": 20, "temperature": 0})[1]["output_ids"] for _ in range(2)]
    assert outs[0] == outs[1]
    assert bool(greedy_ok(hf_models["v0"], PROMPT, outs[0]).all())


def prompt_logprobs(model, prompt: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(prompt[j] | prompt[:j]) for j = 1.. from a plain transformers forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)[:-1]
    return lp.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)


def test_prefill_only_scoring_returns_the_prompt_logprobs(server, hf_models):
    """max_new_tokens 0 with return_logprob and logprob_start_len (how RL frameworks score a sequence): SGLang's
    prefill-only request. input_token_logprobs covers prompt[logprob_start_len:], the first entry's logprob is
    None (SGLang's format at any start), the rest are the model's; nothing is generated. The old server answered
    input_token_logprobs [] without running the model."""
    addr = server.addresses[0]
    model = hf_models["v0"]
    assert get(addr, "/model_info")[1]["weight_version"] == "0"
    seqs = [PROMPT + [11, 12, 13], [9, 8, 7, 6, 5]]
    st, outs = post(addr, "/generate", {"input_ids": seqs, "return_logprob": True, "logprob_start_len": 0,
                                        "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 0}})
    assert st == 200, outs
    for seq, out in zip(seqs, outs):
        m = out["meta_info"]
        assert out["output_ids"] == [] and m["output_token_logprobs"] == [] and m["completion_tokens"] == 0
        assert m["finish_reason"] == {"type": "length", "length": 0}
        inp = m["input_token_logprobs"]
        assert [t for _, t, _ in inp] == seq and inp[0][0] is None
        assert torch.allclose(torch.tensor([x[0] for x in inp[1:]]), prompt_logprobs(model, seq), atol=1e-4)
        tops = m["input_top_logprobs"]
        assert len(tops) == len(seq) and tops[0] is None
        assert all(len(row) == 2 and row[0][0] >= row[1][0] and row[0][0] >= lp - 1e-6
                   for row, (lp, _, _) in zip(tops[1:], inp[1:]))

    seq = seqs[0]  # from position 4, at temperature 0.5 (SGLang scales input logprobs by it too)
    st, out = post(addr, "/generate", {"input_ids": seq, "return_logprob": True, "logprob_start_len": 4,
                                       "sampling_params": {"max_new_tokens": 0, "temperature": 0.5}})
    inp = out["meta_info"]["input_token_logprobs"]
    assert st == 200 and [t for _, t, _ in inp] == seq[4:] and inp[0][0] is None
    assert torch.allclose(torch.tensor([x[0] for x in inp[1:]]), prompt_logprobs(model, seq, 0.5)[4:], atol=1e-4)

    st, out = post(addr, "/generate", {"input_ids": seq, "return_logprob": True, "logprob_start_len": len(seq),
                                       "sampling_params": {"max_new_tokens": 0}})
    assert st == 200 and out["meta_info"]["input_token_logprobs"] == []  # SGLang: nothing from there on
    st, out = post(addr, "/generate", {"input_ids": seq, "return_logprob": True, "logprob_start_len": len(seq) + 1,
                                       "sampling_params": {"max_new_tokens": 0}})
    assert st == 400 and "is higher than the number of input tokens" in out["error"]["message"]


def test_stop_string_spanning_many_tokens(server):
    """A stop string is matched in the decoded output however many tokens it spans (here 12): generation
    ends at the first token whose decoded prefix contains it, and the finish reason names the string."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.spec.model_path)
    addr = server.addresses[0]
    free = gen(addr, sampling_params={"max_new_tokens": 40, "temperature": 0, "ignore_eos": True})[1]["output_ids"]
    stop = tok.decode(free[20:32])
    assert len(stop) >= 12
    expected = next(j for j in range(len(free)) if stop in tok.decode(free[:j + 1])) + 1
    st, out = gen(addr, sampling_params={"max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [stop]})
    assert st == 200 and out["output_ids"] == free[:expected]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_stop_token_kept_and_text_batch(server):
    addr = server.addresses[0]
    first = gen(addr, sampling_params={"max_new_tokens": 5, "temperature": 0})[1]["output_ids"]
    stop_tok = first[2]
    st, out = gen(addr, sampling_params={"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [stop_tok]})
    assert out["output_ids"][-1] == stop_tok and len(out["output_ids"]) == first.index(stop_tok) + 1
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    st, outs = post(addr, "/generate", {"text": ["Natalia sold", "How many"], "sampling_params": {"max_new_tokens": 3}})
    assert st == 200 and isinstance(outs, list) and len(outs) == 2
    assert all(len(o["output_ids"]) == 3 and isinstance(o["text"], str) for o in outs)
    st, out = post(addr, "/generate", {"text": "Natalia", "sampling_params": {"max_new_tokens": 0}})
    assert st == 200 and out["output_ids"] == []


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": PROMPT, "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": PROMPT, "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
        ({"input_ids": [1, 999999]}, "outside"),
        ({"input_ids": []}, "input_ids"),
        ({"sampling_params": {}}, "text or input_ids"),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10**6}}, "context length"),
        ({"input_ids": PROMPT, "sampling_params": {"temperature": float("nan")}}, "temperature must be a finite"),
        ({"input_ids": PROMPT, "sampling_params": {"max_tokens": 2}}, "unknown field `max_tokens`"),
        ({"input_ids": PROMPT, "sampling_params": {"ignore_eos": "false"}}, 'string "false", expected a boolean'),
        ({"input_ids": PROMPT, "return_logprob": "false"}, 'string "false", expected a boolean'),
        ({"input_ids": PROMPT, "sampling_params": {"regex": "a+"}}, "regex is not supported"),
        ({"input_ids": PROMPT, "sampling_params": {"json_schema": "{}"}}, "json_schema is not supported"),
        ({"input_ids": PROMPT, "return_routed_experts": True}, "--enable-return-routed-experts"),
    ],
)
def test_malformed_requests_get_sglang_400(server, body, needle):
    """SGLang 0.5.23's bodies: contract errors {"error": str}, refused values {"error": {"message": str}}."""
    addr = server.addresses[0]
    st, out = post(addr, "/generate", body)
    assert st == 400
    msg = out["error"] if isinstance(out["error"], str) else out["error"]["message"]
    assert needle in msg
    assert gen(addr)[0] == 200  # still serving


def test_no_body_bad_json_and_duplicate_rid(server):
    addr = server.addresses[0]
    assert post(addr, "/pause_generation")[0] == 400  # control endpoints need a body
    st, out = post(addr, "/generate", raw=b"{not json")
    assert st == 400 and "invalid JSON" in out["message"]
    res = {}
    body = {"input_ids": PROMPT, "rid": "dup-1", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    t = threading.Thread(target=lambda: res.setdefault("a", post(addr, "/generate", body)))
    t.start()
    wait_decoding(addr, len(PROMPT))  # the first one is running under its rid
    st, out = post(addr, "/generate", body)
    assert st == 400 and out == {"error": {"message": "Duplicate request ID detected: dup-1"}}
    assert post(addr, "/abort_request", {"rid": "dup"})[0] == 200  # rid matches by prefix
    t.join(60)
    assert res["a"][1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_request_supplied_chat_template_is_refused(server):
    """A client's Jinja template would run in the server unbounded (three nested `range(100000)` loops never end,
    in a thread nothing can cancel); SGLang 0.5.21+ refuses it too. The card's template takes other kwargs."""
    addr, msgs = server.addresses[0], [{"role": "user", "content": "hi"}]
    st, out = post(addr, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1,
                                                  "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}})
    assert st == 400 and "Request-supplied chat_template is not allowed" in out["message"]
    st, out = post(addr, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1,
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert st == 200 and out["usage"]["completion_tokens"] == 1
    # 16 MB of messages: refused before tokenizing (as /generate's text), not tokenized for a minute
    st, out = post(addr, "/v1/chat/completions", {"messages": [{"role": "user", "content": "ab" * (8 << 20)}]})
    assert st == 400 and "characters is longer than the context length" in out["message"]


def test_info_endpoints(server):
    addr = server.addresses[0]
    assert get(addr, "/health")[0] == 200
    st, info = get(addr, "/model_info")
    assert st == 200 and info["is_generation"] and info["weight_version"] == "0"
    assert info["architectures"] == ["Qwen3MoeForCausalLM"]
    st, si = get(addr, "/server_info")
    assert st == 200 and si["tp_size"] == 1 and "max_total_num_tokens" in si
    st, models = get(addr, "/v1/models")
    assert st == 200 and models["data"][0]["id"]
    assert get(addr, "/flush_cache")[0] == 200


def test_frameworks_request_shapes_are_accepted_as_sglang_does(server):
    """Issue 25: AReaL's /init_weights_update_group sends master_port as a string (SGLang's pydantic model coerces
    it; the old server answered 400 on the port): here it gets past the schema to the backend check (nccl on a
    CPU server). slime sends sampling_params.custom_params whenever rollout_top_p < 1 (old: 400); a custom logit
    processor stays refused with SGLang's message, as without --enable-custom-logit-processor."""
    addr = server.addresses[0]
    areal_init = {"master_address": "127.0.0.1", "master_port": str(free_port()), "rank_offset": 1,
                  "world_size": 2, "backend": "nccl", "group_name": "update_weight_group"}
    st, out = post(addr, "/init_weights_update_group", areal_init)
    assert st == 400 and "backend 'nccl' needs CUDA" in out["message"], out
    st, out = post(addr, "/init_weights_update_group", {**areal_init, "master_port": "twenty"})
    assert st == 400 and out["message"].startswith("master_port: Input should be a valid integer"), out

    slime_sp = {"temperature": 1.0, "top_p": 0.9, "top_k": -1, "max_new_tokens": 4, "stop": None,
                "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
                "spaces_between_special_tokens": False, "custom_params": {"return_top_p_token_ids": True}}
    st, out = post(addr, "/generate", {"input_ids": PROMPT, "sampling_params": slime_sp, "return_logprob": True})
    assert st == 200 and len(out["meta_info"]["output_token_logprobs"]) == 4, out
    st, out = post(addr, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2},
                                       "custom_logit_processor": '{"callable": "00"}'})
    assert st == 400 and out["error"]["message"].startswith("The server is not configured to enable custom logit")
    st, si = get(addr, "/server_info")
    assert si["enable_memory_saver"] is False and si["enable_custom_logit_processor"] is False  # as started

    st, out = post(addr, "/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": "3", "temperature": "0",
                                             "logprobs": "1", "stream": "false"})  # OpenAI models coerce too
    assert st == 200 and len(out["choices"][0]["logprobs"]["tokens"]) == 3, out
    st, _ = post(addr, "/abort_request", {})  # SGLang ignores an abort naming nothing (old: 400)
    assert st == 200
    st, out = post(addr, "/pause_generation", {"mode": "later"})
    assert st == 400 and "mode: Input should be 'abort', 'retract' or 'in_place'" in out["message"]


def test_models_retrieve_loads_post_process_and_unknown_routes(server):
    """GET /v1/models/{id} (the openai client's models.retrieve, old: 404), /v1/loads, /post_process_weights
    (nothing to repack on this server: success) and SGLang's error body for a route that does not exist."""
    from openai import NotFoundError, OpenAI

    addr = server.addresses[0]
    client = OpenAI(base_url=f"http://{addr}/v1", api_key="none", max_retries=0)
    served = client.models.list().data[0].id
    card = client.models.retrieve(served)
    assert card.id == served and card.owned_by == "sglang"
    with pytest.raises(NotFoundError):
        client.models.retrieve("no-such-model")
    st, out = get(addr, "/v1/models/no-such-model")
    assert st == 404 and out["error"]["code"] == "model_not_found"

    st, out = get(addr, "/v1/loads")
    assert st == 200 and out["num_accelerators"] == 1 and len(out["loads"]) == 1
    load = out["loads"][0]
    assert load["dp_rank"] == 0 and load["num_running_reqs"] == 0 and load["queues"]["waiting"] == 0
    assert load["max_running_requests"] >= 1 and 0.0 <= load["token_usage"] <= 1.0
    assert "queues" not in get(addr, "/v1/loads?include=core")[1]["loads"][0]
    assert get(addr, "/v1/loads?dp_rank=1")[1]["loads"] == []
    st, out = get(addr, "/v1/loads?include=gpu")
    assert st == 400 and "Invalid include sections" in out["message"]
    st, text = get(addr, "/v1/loads?format=prometheus")
    assert st == 200 and 'sglang_num_running_reqs{dp_rank="0"} 0' in text and "sglang_queues_waiting" in text

    st, out = post(addr, "/post_process_weights", {"restore_weights_before_load": False,
                                                   "post_process_quantization": "true"})
    assert st == 200 and out["success"] is True
    st, out = get(addr, "/no_such_endpoint")
    assert st == 404 and out == {"object": "error", "message": "Not Found", "type": "404", "param": None,
                                 "code": 404}


def test_pause_abort_update_continue_resubmits(server, hf_models, weights_root):
    """Pause mid-generation -> update from disk (version 1) -> continue: the request finishes with both versions."""
    addr = server.addresses[0]
    version = WeightVersion()
    client = SGLangClient([addr], version=version.view())
    sync = reload_sync(version, RolloutSide(client), str(weights_root / "v1"))

    async def main():
        req = ModelRequest(input_ids=PROMPT, max_new_tokens=500, temperature=0.0, ignore_eos=True)
        task = asyncio.create_task(client.agenerate(req))
        await asyncio.to_thread(wait_decoding, addr, len(PROMPT) + 8)  # some tokens at version 0, then the pause
        try:  # the one pause bracket (the sync's): client hold -> pause -> load v1 -> version 1 -> continue
            await asyncio.to_thread(sync.push)
        finally:
            sync.close()
        resp = await task
        info = await client.model_info()
        await client.aclose()
        return resp, info

    resp, info = run(main())
    assert info[0]["weight_version"] == "1"
    v = torch.tensor(resp.output_versions)
    assert len(resp.output_tokens) == 500 and resp.stop_reason == "length"
    assert resp.num_interruptions >= 1
    switch = int((v == 1).nonzero()[0])
    assert 0 < switch and bool((v[:switch] == 0).all()) and bool((v[switch:] == 1).all())
    prompt, out = PROMPT, resp.output_tokens
    assert bool(greedy_ok(hf_models["v0"], prompt, out[:switch]).all())
    # after the switch: the new weights' greedy choice, given prompt + tokens so far
    assert bool(greedy_ok(hf_models["v1"], prompt + out[:switch], out[switch:]).all())
    ref = ref_logprobs(hf_models["v1"], prompt + out[:switch], out[switch:switch + 50], 0.0)
    assert torch.allclose(torch.tensor(resp.output_logprobs[switch:switch + 50]), ref, atol=1e-4)
    # back to v0 for the other tests
    assert post(addr, "/update_weights_from_disk", {"model_path": str(weights_root / "v0"), "weight_version": "0"})[0] == 200


def test_settle_waits_for_aborted_outputs_not_for_requests_held_by_the_pause(server):
    """A checkpoint's snapshot waits (client.settle) for the aborted requests' partial outputs; a request that
    reached the server after /pause_generation waits in its queue with no tokens until /continue_generation,
    so settle must not wait for it (it once blocked the snapshot for trainer.sync_timeout)."""
    addr = server.addresses[0]
    client = SGLangClient([addr])

    async def main():
        long = ModelRequest(input_ids=PROMPT, max_new_tokens=500, temperature=0.0, ignore_eos=True, rid="settle-a")
        partial = ModelResponse(input_tokens=list(PROMPT))  # extended in place as outputs arrive
        running = asyncio.create_task(client.agenerate(long, resume=partial))
        await asyncio.to_thread(wait_decoding, addr, len(PROMPT) + 8)  # it has output for the abort to return
        # the race: a request takes its send slot just before the pause (a request that has none waits in the
        # client while paused), and reaches the server after /pause_generation
        late, holding, choose = asyncio.Event(), asyncio.Event(), client._choose

        async def choose_late(rid):
            if rid == "settle-b":
                holding.set()
                await late.wait()
            return await choose(rid)

        client._choose = choose_late
        held = asyncio.create_task(client._generate_once("settle-b", {
            "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
            "return_logprob": True, "rid": "settle-b"}))
        await holding.wait()  # it holds its slot
        client.pause()
        await client.pause_generation()
        try:  # the module's server is shared: never leave it paused
            aborted_back = await asyncio.to_thread(client.settle, 60.0, 0.5)  # the aborted output came back
            got = len(partial.output_tokens)
            late.set()  # sent while paused
            while not sum(x.in_flight for x in client.servers):
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            still = await asyncio.to_thread(client.settle, 60.0, 0.5)
            waited = time.monotonic() - t0
        finally:
            await client.continue_generation()
            client.resume()
        out, _ = await held
        resp = await running
        return aborted_back, got, still, waited, out, resp

    aborted_back, got, still, waited, out, resp = run(main())
    assert aborted_back == 0 and got > 0  # the aborted round's tokens were in the response before settle returned
    assert still == 1 and waited < 30  # the held one is reported, not waited for (the bound is 60 s)
    assert len(out["output_ids"]) == 8 and len(resp.output_tokens) == 500


def test_failed_updates_answer_400_and_keep_old_weights(server, hf_models, weights_root, tmp_path):
    addr = server.addresses[0]
    before = gen(addr, sampling_params={"max_new_tokens": 8, "temperature": 0})[1]["output_ids"]
    st, out = post(addr, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert st == 400 and out["success"] is False and "outside the allowed weights root" in out["message"]
    st, out = post(addr, "/update_weights_from_disk", {"model_path": str(weights_root / "missing")})
    assert st == 400 and "not a directory" in out["message"]
    bad = weights_root / "bad_shape"
    bad.mkdir(exist_ok=True)
    sd = {k: v.clone() for k, v in hf_models["v1"].state_dict().items() if "experts" not in k}
    sd["model.embed_tokens.weight"] = torch.zeros(7, 3)
    save_file(sd, str(bad / "model.safetensors"))
    st, out = post(addr, "/update_weights_from_disk", {"model_path": str(bad), "weight_version": "9"})
    assert st == 400 and "shape" in out["message"] and "Rolled back" in out["message"]
    assert get(addr, "/model_info")[1]["weight_version"] == "0"
    assert gen(addr, sampling_params={"max_new_tokens": 8, "temperature": 0})[1]["output_ids"] == before


def _trainer_rank0(port: int, names: list, path: str, q) -> None:
    """A separate process acting as trainer rank 0: join the group, broadcast new weights in order."""
    import datetime

    import torch.distributed as dist
    from safetensors.torch import load_file

    from mega_async.utils.comm import init_custom_process_group

    try:
        pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "wu", datetime.timedelta(seconds=60))
        sd = load_file(path)
        for n in names:
            dist.broadcast(sd[n].contiguous(), src=0, group=pg)
        dist.destroy_process_group(pg)
        q.put("ok")
    except Exception as e:  # noqa: BLE001
        q.put(repr(e))


def test_distributed_update_over_gloo(server, hf_models, weights_root):
    from safetensors import safe_open

    addr = server.addresses[0]
    path = str(weights_root / "v1" / "model.safetensors")
    with safe_open(path, "pt") as f:
        names = sorted(f.keys())
        shapes = [list(f.get_slice(n).get_shape()) for n in names]
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    trainer = ctx.Process(target=_trainer_rank0, args=(port, names, path, q))
    trainer.start()
    client = SGLangClient([addr])

    async def main():
        world = await client.init_weights_update_group("127.0.0.1", port, "wu", backend="gloo")
        assert world == 2
        await client.begin_weight_update()  # the server mirrors SGLang 0.5.23: updates run inside a session
        assert client.sessions_open == [client.addresses[0]]
        await client.update_weights_from_distributed(names, ["float32"] * len(names), shapes, "wu", version=5)
        await client.end_weight_update()
        assert client.sessions_open == []
        await client.destroy_weights_update_group("wu")
        await client.aclose()

    run(main())
    trainer.join(60)
    assert q.get(timeout=5) == "ok"
    st, out = gen(addr, sampling_params={"max_new_tokens": 16, "temperature": 1.0})
    assert out["meta_info"]["weight_version"] == "5"
    lps = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(lps, ref_logprobs(hf_models["v1"], PROMPT, out["output_ids"], 1.0), atol=1e-4)
    assert post(addr, "/update_weights_from_disk", {"model_path": str(weights_root / "v0"), "weight_version": "0"})[0] == 200


def test_in_place_pause_keeps_requests_and_update_waits_without_pause(server, weights_root):
    addr = server.addresses[0]
    res, order = {}, []
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}, "return_logprob": True}

    def long_request(key):
        res[key] = post(addr, "/generate", body)
        order.append(key)

    t = threading.Thread(target=long_request, args=("gen",))
    t.start()
    wait_decoding(addr, len(PROMPT))
    assert post(addr, "/pause_generation", {"mode": "in_place"})[0] == 200
    time.sleep(0.1)
    steps = get(addr, "/server_info")[1]
    time.sleep(0.4)
    held = get(addr, "/server_info")[1]
    assert held["num_running_reqs"] == 1 and "gen" not in res  # kept open, not decoding, not answered
    # while paused, an update runs at once (flush_cache false, as with SGLang's in_place mode)
    st, out = post(addr, "/update_weights_from_disk",
                   {"model_path": str(weights_root / "v0"), "weight_version": "0", "flush_cache": False})
    assert st == 200 and out["success"]
    assert post(addr, "/continue_generation", {})[0] == 200
    t.join(60)
    st, out = res["gen"]
    assert st == 200 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out["output_ids"]) == 300 and steps["num_running_reqs"] == 1
    # without a pause, an update waits for the request in flight (writer lock)
    t = threading.Thread(target=long_request, args=("gen2",))
    t.start()
    wait_decoding(addr, len(PROMPT))
    st, _ = post(addr, "/update_weights_from_disk", {"model_path": str(weights_root / "v0"), "weight_version": "0"})
    order.append("update")
    t.join(60)
    assert st == 200 and order[-2:] == ["gen2", "update"]
    assert res["gen2"][1]["meta_info"]["finish_reason"]["type"] == "length"
