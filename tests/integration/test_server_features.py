"""The embedded server's protocol surface for RL frameworks, against plain transformers forwards."""
import json
import os
import threading
import time
import urllib.request

import pytest
import torch

from .conftest import get, post, ref_logprobs

pytestmark = pytest.mark.slow  # starts servers or trainer ranks: CI's second step keeps the default suite under 20 minutes on 2 cores

PROMPT = [5, 17, 300, 42, 7, 99, 12, 64]


def gen(addr, sp, **kw):
    st, out = post(addr, "/generate", {"input_ids": PROMPT, "sampling_params": sp, **kw})
    assert st == 200, out
    return out


def test_prompt_and_top_logprobs(server, hf_models):
    out = gen(server.addresses[0], {"max_new_tokens": 6, "temperature": 0.7, "ignore_eos": True},
              return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    m = out["meta_info"]
    inp = m["input_token_logprobs"]
    assert [t for _, t, _ in inp] == PROMPT and inp[0][0] is None
    with torch.no_grad():
        logits = hf_models["v0"](torch.tensor([PROMPT])).logits[0].float()
    ref = torch.log_softmax(logits / 0.7, -1)[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor([x[0] for x in inp[1:]]), ref, atol=1e-4)
    for (lp, tok, _), top in zip(m["output_token_logprobs"], m["output_top_logprobs"]):
        assert len(top) == 3 and top[0][0] >= top[1][0] >= top[2][0] and lp <= top[0][0] + 1e-6
    assert len(m["input_top_logprobs"]) == len(PROMPT) and m["input_top_logprobs"][0] is None


def test_token_ids_logprob(server, hf_models):
    """SGLang's token_ids_logprob (bench_serving --token-ids-logprob): the asked tokens' logprobs at every prompt
    and output position, as [logprob, id, text] in meta_info input/output_token_ids_logprobs."""
    ids = [3, 300, 1000]
    out = gen(server.addresses[0], {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True},
              return_logprob=True, logprob_start_len=0, token_ids_logprob=ids)
    m = out["meta_info"]
    with torch.no_grad():
        logits = hf_models["v0"](torch.tensor([PROMPT + out["output_ids"]])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[:, ids]
    inp, outp = m["input_token_ids_logprobs"], m["output_token_ids_logprobs"]
    assert inp[0] is None and len(inp) == len(PROMPT) and len(outp) == 4
    got = torch.tensor([[lp for lp, _, _ in row] for row in inp[1:] + outp])
    assert [[t for _, t, _ in row] for row in outp] == [ids] * 4
    assert torch.allclose(got, ref[:len(PROMPT) - 1 + 4], atol=1e-4)
    st, bad = post(server.addresses[0], "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                                      "token_ids_logprob": [5, 10 ** 9]})
    assert st == 400 and "outside the vocabulary" in json.dumps(bad)


def test_n_samples_share_one_prefill(server, hf_models):
    """n=4 of one prompt: one warm-up prefill, then all four report cached_tokens = len(prompt) - 1 (as SGLang,
    which prefills the prompt with max_new_tokens=0 before the samples), and their logprobs are the model's."""
    addr = server.addresses[0]
    outs = gen(addr, {"max_new_tokens": 8, "temperature": 1.0, "n": 4, "ignore_eos": True}, return_logprob=True)
    assert isinstance(outs, list) and len(outs) == 4
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [len(PROMPT) - 1] * 4
    for o in outs:
        lps = torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(lps, ref_logprobs(hf_models["v0"], PROMPT, o["output_ids"], 1.0), atol=1e-4)
    again = gen(addr, {"max_new_tokens": 2, "temperature": 1.0})
    assert again["meta_info"]["cached_tokens"] == len(PROMPT) - 1


@pytest.mark.slow
def test_sampling_controls(server):
    addr = server.addresses[0]
    sp = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1234}
    a, b = gen(addr, sp)["output_ids"], gen(addr, sp)["output_ids"]
    assert a == b  # the seed fixes the draw
    assert gen(addr, {**sp, "sampling_seed": 99})["output_ids"] != a
    assert set(gen(addr, {**sp, "logit_bias": {"77": 100.0}})["output_ids"]) == {77}
    rep = gen(addr, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "logit_bias": {"77": 5.0},
                     "frequency_penalty": 2.0, "repetition_penalty": 2.0})["output_ids"]
    assert rep[0] == 77 and rep.count(77) < 12  # penalties push back on the repeated token
    greedy = gen(addr, {"max_new_tokens": 10, "temperature": 0})["output_ids"]
    stop = greedy[1]
    early = gen(addr, {"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [stop]})["output_ids"]
    late = gen(addr, {"max_new_tokens": 10, "temperature": 0, "stop_token_ids": [stop], "min_new_tokens": 5})
    assert len(early) <= 2 and len(late["output_ids"]) >= 5 and stop not in late["output_ids"][:5]
    # SGLang's Req._check_token_based_finish: ignore_eos ignores the request's stop_token_ids too
    biased = {"max_new_tokens": 6, "temperature": 0, "logit_bias": {"77": 100.0}, "stop_token_ids": [77]}
    assert gen(addr, biased)["output_ids"] == [77]
    full = gen(addr, {**biased, "ignore_eos": True})
    assert full["output_ids"] == [77] * 6 and full["meta_info"]["finish_reason"]["type"] == "length"


def test_stream_is_sse_with_cumulative_chunks(server):
    addr = server.addresses[0]
    body = {"input_ids": PROMPT, "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(f"http://{addr}/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [line[6:] for line in r.read().decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = [json.loads(e) for e in events[:-1]]
    lens = [len(c["output_ids"]) for c in chunks]
    assert lens == sorted(lens) and lens[-1] == 10
    final = gen(addr, {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
    assert chunks[-1]["output_ids"] == final["output_ids"] and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.slow
def test_flush_while_paused_versions_and_info(server, weights_root):
    addr = server.addresses[0]
    res = {}
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
    t = threading.Thread(target=lambda: res.setdefault("r", post(addr, "/generate", body)))
    t.start()
    while get(addr, "/server_info")[1]["num_running_reqs"] == 0:
        time.sleep(0.02)
    assert post(addr, "/pause_generation", {"mode": "in_place"})[0] == 200
    assert post(addr, "/flush_cache", {})[0] == 400  # a request is held in the batch
    st, out = post(addr, "/update_weights_from_disk", {"model_path": str(weights_root / "v1"), "weight_version": "7"})
    assert st == 200, out
    assert post(addr, "/continue_generation", {})[0] == 200
    t.join(120)
    meta = res["r"][1]["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "7"] and spans[0]["start"] == 0 and spans[-1]["end"] == 60
    assert meta["weight_version"] == "7"
    assert get(addr, "/model_info")[1]["model_path"] == str(weights_root / "v1")
    assert get(addr, "/model_info")[1]["weight_version"] == "7"  # SGLang has no /get_weight_version since 0.5.18
    assert post(addr, "/pause_generation", {"mode": "abort"})[0] == 200
    assert post(addr, "/flush_cache", {})[0] == 200  # paused and idle: SGLang flushes
    assert post(addr, "/update_weights_from_disk", {"model_path": str(weights_root / "v0"),
                                                    "weight_version": "0"})[0] == 200
    assert post(addr, "/continue_generation", {})[0] == 200
    st, out = post(addr, "/update_weight_version", {"new_version": "0"})
    assert st == 200 and out["new_version"] == "0"
    st, out = post(addr, "/update_weights_from_tensor", {"serialized_named_tensors": []})
    assert st == 400 and "update_weights_from_tensor" in out["message"]
    si = get(addr, "/server_info")[1]
    assert si["enable_memory_saver"] is False and si["disable_radix_cache"] is False and si["dp_size"] == 1


def test_weight_files_outside_root_fifo_and_corrupt_are_refused(server, weights_root, tmp_path):
    addr = server.addresses[0]
    link, fifo, bad = (weights_root / n for n in ("link", "fifo", "corrupt"))
    for d in (link, fifo, bad):
        d.mkdir(exist_ok=True)
    outside = tmp_path / "model.safetensors"
    outside.write_bytes((weights_root / "v1" / "model.safetensors").read_bytes())
    if not (link / "model.safetensors").exists():
        (link / "model.safetensors").symlink_to(outside)
        os.mkfifo(fifo / "model.safetensors")
        (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    bodies = []
    for d, needle in ((link, "outside the allowed weights root"), (fifo, "not a regular file"), (bad, "cannot read")):
        t0 = time.monotonic()
        st, out = post(addr, "/update_weights_from_disk", {"model_path": str(d), "weight_version": "9"})
        assert st == 400 and out["success"] is False and needle in out["message"], out
        assert time.monotonic() - t0 < 30
        bodies.append(sorted(out))
    assert bodies[0] == bodies[1] == bodies[2]  # one error body for every load failure
    assert get(addr, "/model_info")[1]["weight_version"] == "0"


def test_release_and_resume_memory(server):
    addr = server.addresses[0]
    before = gen(addr, {"max_new_tokens": 8, "temperature": 0})["output_ids"]
    weights = get(addr, "/server_info")[1]["resident_weight_bytes"]
    assert post(addr, "/release_memory_occupation", {})[0] == 200
    si = get(addr, "/server_info")[1]
    assert si["resident_weight_bytes"] == 0 and si["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
    st, out = post(addr, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert st == 400 and "resume_memory_occupation" in out["error"]["message"]
    assert post(addr, "/resume_memory_occupation", {})[0] == 200
    assert get(addr, "/server_info")[1]["resident_weight_bytes"] == weights
    assert gen(addr, {"max_new_tokens": 8, "temperature": 0})["output_ids"] == before


@pytest.mark.slow
def test_huge_text_prompt_is_refused_without_freezing(server):
    addr = server.addresses[0]
    t0 = time.monotonic()
    st, out = post(addr, "/generate", {"text": "word " * 4_000_000, "sampling_params": {"max_new_tokens": 1}})
    assert st == 400 and "longer than the context length" in out["error"]["message"]
    assert time.monotonic() - t0 < 20 and get(addr, "/health")[0] == 200
