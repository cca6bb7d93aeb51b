"""One conformance suite, two engines: the SGLang protocol as the project uses it, asked of the embedded server and
of the real SGLang 0.5.23 CPU engine (slow, sglang; one server per engine for the module), with the same card in
float32 and `--enable-return-routed-experts` on both (marked slow for both). Every answer is held to SGLang's shape and, where a number is
asked, to transformers' forward of the card. The differences the two engines show are listed in docs/inference.md
("Conformance: what differs between the two engines"), each fixed or kept on purpose.
"""
import base64
import http.client
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from mega_async.inference.servers import ServerLauncher, ServerSpec
from mega_async.bridge.model_cards import ensure_weights
from .conftest import REAL_ENGINE, get, post

ROOT = Path(__file__).resolve().parents[2]
CARD = ROOT / "models" / "tiny-qwen3-moe"
P = [3, 14, 15, 92, 65, 35, 89, 79]
REAL = pytest.param("sglang", marks=REAL_ENGINE)


# slow on both: the embedded server's own protocol tests run in the default suite already; this module's worth is the
# comparison, so both engines run it side by side in CI's real-engine group (.ci/run, group B)
@pytest.fixture(scope="module", params=[pytest.param("embedded", marks=pytest.mark.slow), REAL])
def server(request, tmp_path_factory):
    ensure_weights(CARD)
    kw = {"device": "cpu"} if request.param == "sglang" else {}
    spec = ServerSpec(request.param, str(CARD), dtype="float32", num_threads=1,
                      extra_args=["--enable-return-routed-experts"], **kw)
    with ServerLauncher(spec, log_dir=str(tmp_path_factory.mktemp("conformance")), startup_timeout=400) as launcher:
        yield launcher.addresses[0]


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(CARD, dtype=torch.float32).eval()


def generate(address: str, **body) -> dict:
    status, out = post(address, "/generate", {"input_ids": P, **body})
    assert status == 200, out
    return out


def greedy(n: int, **extra) -> dict:
    return {"sampling_params": {"max_new_tokens": n, "temperature": 0, **extra}}


def version(address: str) -> str:
    status, info = get(address, "/model_info")
    assert status == 200
    return info["weight_version"]


def test_generate_shape_and_greedy_tokens(server, hf):
    out = generate(server, **greedy(5))
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 5 and isinstance(out["text"], str) and isinstance(meta["id"], str)
    assert {k: meta[k] for k in ("num_retractions", "reasoning_tokens", "cached_tokens_details", "dp_rank")} == {
        "num_retractions": 0, "reasoning_tokens": 0, "cached_tokens_details": None, "dp_rank": None}
    assert isinstance(meta["response_sent_to_client_ts"], float)
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == 8 and meta["completion_tokens"] == 5
    assert meta["weight_versions"] == [{"version": version(server), "start": 0, "end": 5}]
    with torch.no_grad():  # greedy = transformers' argmax, token by token
        ref = hf.generate(torch.tensor([P]), max_new_tokens=5, do_sample=False)[0, len(P):].tolist()
    assert out["output_ids"] == ref


def test_logprob_formats_equal_transformers(server, hf):
    out = generate(server, **greedy(4), return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
    meta = out["meta_info"]
    ids = P + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
    assert meta["input_token_logprobs"][0] == [None, P[0], None]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == P
    got = torch.tensor([lp for lp, _, _ in meta["input_token_logprobs"][1:]] +
                       [lp for lp, _, _ in meta["output_token_logprobs"]], dtype=torch.float64)
    want = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert (got - want).abs().max() < 1e-4
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert meta["output_token_logprobs_length"] == 4
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    text = generate(server, **greedy(3), return_logprob=True, return_text_in_logprobs=True)["meta_info"]
    assert all(isinstance(t, str) for _, _, t in text["output_token_logprobs"])
    # max_new_tokens 0 with logprob_start_len: SGLang's prefill-only scoring
    score = generate(server, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    assert score["output_ids"] == [] and len(score["meta_info"]["input_token_logprobs"]) == len(P)
    assert score["meta_info"]["input_token_logprobs"][0][0] is None


def test_batch_n_stop_and_min_new_tokens(server):
    status, batch = post(server, "/generate", {"input_ids": [P, P[:4]], **greedy(3)})
    assert status == 200 and isinstance(batch, list) and [len(b["output_ids"]) for b in batch] == [3, 3]
    status, n = post(server, "/generate", {"input_ids": P, "sampling_params": {"max_new_tokens": 3, "n": 3}})
    assert status == 200 and isinstance(n, list) and len(n) == 3
    first = generate(server, **greedy(5))["output_ids"]
    stop = generate(server, **greedy(5, stop_token_ids=[first[2]]))
    assert stop["output_ids"] == first[:3]  # token ids keep the matched stop token; the text drops it
    assert stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": first[2]}
    kept = generate(server, **greedy(5, stop_token_ids=[first[2]], no_stop_trim=True))
    assert kept["output_ids"] == first[:3] and len(kept["text"]) >= len(stop["text"])
    assert len(generate(server, **greedy(4, min_new_tokens=4))["output_ids"]) == 4


def test_unknown_sampling_key_is_refused(server):
    status, out = post(server, "/generate", {"input_ids": P, "sampling_params": {"max_new_tokens": 3, "bogus": 1}})
    assert status == 400 and "unknown field `bogus`" in str(out)


def long_request(server: str, box: dict, rid: str = None) -> threading.Thread:
    """A 600-token greedy request streamed on a thread; returns once its first tokens have arrived (an event, not a
    sleep: a fast engine must not finish before the test pauses or aborts it). box["out"] is (status, the last event),
    which SGLang makes the whole response so far."""
    body = {"input_ids": P, "stream": True,
            "sampling_params": {"max_new_tokens": 600, "temperature": 0, "ignore_eos": True}}
    if rid:
        body["rid"] = rid
    started = threading.Event()

    def consume():
        host, port = server.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=300)
        try:
            conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            last = None
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                last = json.loads(line[5:])
                if last.get("output_ids"):
                    started.set()
            box["out"] = (resp.status, last)
        finally:
            conn.close()
            started.set()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(300), "the long request produced no token in 300 s"
    assert t.is_alive(), f"the long request ended before it could be paused: {box.get('out')}"
    return t


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes(server, mode):
    """abort: the request in flight answers with its partial output (finish_reason abort); retract and in_place: it is
    held and finishes whole after /continue_generation."""
    box: dict = {}
    t = long_request(server, box)
    try:
        status, out = post(server, "/pause_generation", {"mode": mode})
        assert status == 200 and out["status"] == "ok"
        time.sleep(1.0)
        if mode != "abort":
            assert t.is_alive()  # held while paused
    finally:
        assert post(server, "/continue_generation", {})[0] == 200
    t.join(300)
    status, out = box["out"]
    assert status == 200
    meta = out["meta_info"]
    if mode == "abort":
        assert meta["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        assert len(out["output_ids"]) < 600
    else:
        assert meta["finish_reason"] == {"type": "length", "length": 600}
    assert (meta["num_retractions"] >= 1) == (mode == "retract")  # SGLang counts each retraction of a request


def test_abort_request(server):
    box: dict = {}
    t = long_request(server, box, rid="conformance-abort")
    assert post(server, "/abort_request", {"rid": "conformance-abort"})[0] == 200
    t.join(300)
    status, out = box["out"]
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 600


def test_weight_update_sessions_and_versions(server):
    status, out = post(server, "/end_weight_update", {})
    assert status == 400 and out["message"].startswith("no weight-update session is open")
    assert post(server, "/begin_weight_update", {"selector": "all"}) == (200, {"success": True, "message": "Success"})
    status, out = post(server, "/begin_weight_update", {"selector": "all"})
    assert status == 400 and out["message"].startswith("a weight-update session is already open")
    assert post(server, "/end_weight_update", {})[0] == 200
    status, out = post(server, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [],
                                                                    "group_name": "none"})
    assert status == 400 and "between begin_weight_update() and end_weight_update()" in out["message"]
    status, out = post(server, "/update_weight_version", {"new_version": "7"})
    assert status == 200 and out["new_version"] == "7" and version(server) == "7"
    assert generate(server, **greedy(2))["meta_info"]["weight_versions"] == [{"version": "7", "start": 0, "end": 2}]


def test_model_and_server_info(server):
    status, info = get(server, "/model_info")
    assert status == 200
    assert info["model_path"] == str(CARD) and info["is_generation"] is True and info["model_type"] == "qwen3_moe"
    assert info["architectures"] == ["Qwen3MoeForCausalLM"] and isinstance(info["weight_version"], str)
    assert {k: info[k] for k in ("reasoning_parser", "tool_call_parser", "disaggregation_mode",
                                 "has_image_understanding", "has_audio_understanding")} == {
        "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
        "has_image_understanding": False, "has_audio_understanding": False}
    assert get(server, "/get_model_info")[1]["model_type"] == "qwen3_moe"
    status, sinfo = get(server, "/server_info")
    assert status == 200 and sinfo["version"] == "0.5.23" and isinstance(sinfo["internal_states"], list)
    assert get(server, "/health")[0] == 200 and get(server, "/health_generate")[0] == 200
    status, models = get(server, "/v1/models")
    assert status == 200 and models["data"][0]["id"] == str(CARD)


def test_routed_experts(server, hf):
    """int32 (tokens - 1) x layers x top-k, base64; the experts transformers' router picks for the same sequence."""
    out = generate(server, **greedy(3), return_routed_experts=True)
    routes = torch.frombuffer(bytearray(base64.b64decode(out["meta_info"]["routed_experts"])), dtype=torch.int32)
    cfg = hf.config
    ids = P + out["output_ids"]
    routes = routes.view(len(ids) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    with torch.no_grad():
        logits = hf(torch.tensor([ids[:-1]]), output_router_logits=True).router_logits
    for layer, lg in enumerate(logits):
        want = lg.view(len(ids) - 1, -1).topk(cfg.num_experts_per_tok, -1).indices
        assert torch.equal(routes[:, layer].sort(-1).values, want.sort(-1).values.to(torch.int32)), layer


def test_flush_cache(server):
    for status, out in (post(server, "/flush_cache", {}), get(server, "/flush_cache")):
        assert status == 200 and out.startswith("Cache flushed.")


def test_openai_endpoints(server):
    status, out = post(server, "/v1/completions", {"model": "x", "prompt": [P], "max_tokens": 3, "temperature": 0,
                                                   "logprobs": 1})
    assert status == 200 and out["object"] == "text_completion"
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["logprobs"]["token_logprobs"]) == 3
    assert out["usage"]["prompt_tokens"] == 8 and out["usage"]["completion_tokens"] == 3
    assert out["metadata"]["weight_versions"][0]["end"] == 3
    status, chat = post(server, "/v1/chat/completions", {"model": "x", "max_tokens": 3, "temperature": 0,
                                                         "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] == 3
