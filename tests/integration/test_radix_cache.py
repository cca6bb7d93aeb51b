"""The embedded server's radix cache against SGLang's numbers and a plain transformers forward.

SGLang's cached_tokens sequence over HTTP; a hit (a multi-turn extension, a GRPO group, prompt logprobs from a
cached prefix, a batch mixing hits and misses) gives the model's logprobs; weight changes, retract, flush and
--disable-radix-cache behave as SGLang's. Engine-level tests drive the engine directly (cheap and exact about
when a weight change lands)."""
import threading

import pytest
import torch

from mega_async.server.engine import GenerationEngine, GenRequest

from .conftest import get, post, ref_logprobs
from .server_inproc import InProcessServer

BASE = [1 + i % 1000 for i in range(1100)]  # SGLang's 0..1099, inside the tiny model's 1024-token vocabulary


@pytest.fixture(scope="module")
def radix_server(weights_root):
    with InProcessServer(str(weights_root / "v0"), weights_root=str(weights_root)) as s:
        yield s.address


@pytest.fixture(scope="module")
def engine(weights_root):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights_root / "v0", dtype=torch.float32)
    eng = GenerationEngine(model, prefix_cache_tokens=1 << 16)
    yield eng
    eng.shutdown()


def generate(addr, ids, sp=None, **top):
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, **(sp or {})}
    body = {"input_ids": ids, "sampling_params": sp, **top}
    st, out = post(addr, "/generate", body)
    assert st == 200, out
    return out


def run(eng, reqs, on_step=None):
    """Add the requests in one admission round (engine held in place meanwhile) and wait for all of them."""
    left, done = len(reqs), threading.Event()
    lock = threading.Lock()

    def fin(_):
        nonlocal left
        with lock:
            left -= 1
            if left == 0:
                done.set()

    eng.pause("in_place").result(30)
    for r in reqs:
        r.on_finish, r.on_step = fin, on_step
        eng.add_request(r)
    eng.resume().result(30)
    assert done.wait(120), "requests did not finish"
    return reqs


def req(rid, ids, **kw):
    return GenRequest(rid=rid, input_ids=list(ids), **{"max_new_tokens": 6, "ignore_eos": True, **kw})


def out_lps(r):
    return torch.tensor(r.output_logprobs)


def test_sglang_cached_tokens_sequence(radix_server, weights_root):
    """SGLang's test: prompts 0..99, 0..999, 0..999, 0..499, 0..1099 -> cached 0, 100, 999, 499, 1000
    (the tree never gives the last token; the second 0..999 finds the first one's prompt)."""
    lens = (100, 1000, 1000, 500, 1100)
    got = [generate(radix_server, BASE[:n])["meta_info"]["cached_tokens"] for n in lens]
    assert got == [0, 100, 999, 499, 1000]
    info = get(radix_server, "/server_info")[1]
    assert info["disable_radix_cache"] is False and info["prefix_cache"]["hit_tokens"] >= sum(got)
    with InProcessServer(str(weights_root / "v0"), weights_root=str(weights_root), prefix_cache_tokens=0) as cold:
        assert [generate(cold.address, BASE[:n])["meta_info"]["cached_tokens"] for n in (40, 40, 60)] == [0, 0, 0]
        assert get(cold.address, "/server_info")[1]["disable_radix_cache"] is True


def test_multi_turn_hit_gives_the_models_logprobs(radix_server, hf_models):
    """Each turn extends the last (prompt + reply + new text): the next turn finds all of it but the last
    token, and what it samples has exactly the logprobs of a cold forward."""
    model, seq = hf_models["v0"], BASE[200:440]
    for turn in range(3):
        out = generate(radix_server, seq, {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": turn},
                       return_logprob=True)
        m = out["meta_info"]
        if turn:
            assert m["cached_tokens"] == len(seq) - 18 - 1  # the previous prompt + reply, but the reply's last token
        lps = torch.tensor([x[0] for x in m["output_token_logprobs"]])
        assert torch.allclose(lps, ref_logprobs(model, seq, out["output_ids"], 1.0), atol=1e-4)
        seq = seq + out["output_ids"] + BASE[600 + 30 * turn:630 + 30 * turn][:18]  # 12 + 18 = 30 new


def test_prompt_logprobs_from_a_cached_prefix(radix_server, hf_models):
    """logprob_start_len k on a cached prompt: k tokens cached (SGLang's limit), None at k, then the model's."""
    ids = BASE[:300]
    generate(radix_server, ids)
    out = generate(radix_server, ids, return_logprob=True, logprob_start_len=120, top_logprobs_num=2)
    m = out["meta_info"]
    assert m["cached_tokens"] == 120
    inp = m["input_token_logprobs"]
    assert [t for _, t, _ in inp] == ids[120:] and inp[0][0] is None and m["input_top_logprobs"][0] is None
    with torch.no_grad():
        logits = hf_models["v0"](torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[120:-1].gather(1, torch.tensor(ids[121:])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor([x[0] for x in inp[1:]]), ref, atol=1e-4)
    assert generate(radix_server, ids, return_logprob=True, logprob_start_len=0)["meta_info"]["cached_tokens"] == 0


def test_prefill_only_scoring_uses_and_fills_the_tree(radix_server, hf_models):
    """max_new_tokens 0 (scoring) is a prefill like any other in SGLang: it matches (up to logprob_start_len)
    and its prompt goes into the tree, so a later request on that prompt finds it."""
    ids = BASE[400:520]
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}}
    st, out = post(radix_server, "/generate", body)
    assert st == 200 and out["meta_info"]["cached_tokens"] == 0 and out["output_ids"] == []
    st, out = post(radix_server, "/generate", {**body, "logprob_start_len": 50})
    assert st == 200 and out["meta_info"]["cached_tokens"] == 50
    inp = out["meta_info"]["input_token_logprobs"]
    with torch.no_grad():
        logits = hf_models["v0"](torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[50:-1].gather(1, torch.tensor(ids[51:])[:, None]).squeeze(1)
    assert inp[0][0] is None and torch.allclose(torch.tensor([x[0] for x in inp[1:]]), ref, atol=1e-4)
    assert generate(radix_server, ids)["meta_info"]["cached_tokens"] == len(ids) - 1


def test_group_samples_all_join_from_one_warmup(radix_server, hf_models):
    """n samples of one prompt: one warm-up prefill, then every sample reports len - 1 cached (as SGLang,
    which prefills the prompt with max_new_tokens=0 before the samples), with the model's logprobs."""
    ids = BASE[50:90]
    st, outs = post(radix_server, "/generate", {"input_ids": ids, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 6, "temperature": 1.0, "n": 4, "ignore_eos": True}})
    assert st == 200 and [o["meta_info"]["cached_tokens"] for o in outs] == [len(ids) - 1] * 4
    for o in outs:
        lps = torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(lps, ref_logprobs(hf_models["v0"], ids, o["output_ids"], 1.0), atol=1e-4)


def test_flush_cache_empties_the_tree(radix_server):
    ids = BASE[700:760]
    generate(radix_server, ids)
    assert generate(radix_server, ids)["meta_info"]["cached_tokens"] == len(ids) - 1
    assert post(radix_server, "/flush_cache", {})[0] == 200
    assert generate(radix_server, ids)["meta_info"]["cached_tokens"] == 0
    assert get(radix_server, "/server_info")[1]["prefix_cache"]["tokens"] == len(ids) + 3


def test_one_batch_of_hits_misses_and_partial_hits(engine, hf_models):
    """One prefill forward mixing rows with different cached prefix lengths (and none): every row's
    tokens have the model's logprobs, and each reports its own cached_tokens."""
    a, b = BASE[0:180], BASE[300:420]
    run(engine, [req("warm-a", a), req("warm-b", b)])
    rows = [req("ext-a", a + BASE[900:960], temperature=1.0, sampling_seed=1),  # 180 cached, 60 new
            req("fresh", BASE[500:530], temperature=1.0, sampling_seed=2),  # nothing cached
            req("part-b", b[:70] + [3, 4, 5], temperature=1.0, sampling_seed=3),  # 70 cached
            req("hit-b", b, temperature=1.0, sampling_seed=4)]  # joins mid-decode (119 cached)
    run(engine, rows)
    assert [r.cached_tokens for r in rows] == [180, 0, 70, 119]
    for r in rows:
        assert torch.allclose(out_lps(r), ref_logprobs(hf_models["v0"], r.input_ids, r.output_ids, 1.0), atol=1e-4)
    engine.prefix_cache.check()
    assert engine.prefix_cache.protected_tokens == 0  # every lock was given back


def test_kv_from_before_a_weight_change_is_never_cached(engine, weights_root, hf_models):
    """New weights land while a request runs (an in-place update): its KV mixes both versions, so when it
    finishes it must not enter the (reset) tree; the next turn is computed afresh under the new weights."""
    from mega_async.server.weights import load_named_tensors, read_safetensors_dir

    v1 = list(read_safetensors_dir(weights_root / "v1"))
    v0 = list(read_safetensors_dir(weights_root / "v0"))
    ids = BASE[40:140]

    def swap(named):
        def do():
            load_named_tensors(engine.model, named, strict=True)
            engine.prefix_cache.clear()  # what every weight load does (updates.py)
        return do

    def on_step(r):
        if len(r.output_ids) == 3:
            engine.run_command(swap(v1))  # runs between two decode steps of this request

    try:
        first, = run(engine, [req("mid-update", ids, max_new_tokens=8)], on_step=on_step)
        nxt, = run(engine, [req("next-turn", first.seq + [7, 8], temperature=1.0, sampling_seed=5)])
        assert nxt.cached_tokens == 0
        assert torch.allclose(out_lps(nxt), ref_logprobs(hf_models["v1"], nxt.input_ids, nxt.output_ids, 1.0),
                              atol=1e-4)
    finally:
        engine.run_command(swap(v0)).result(30)


def test_retracted_request_keeps_its_first_cached_tokens(engine, hf_models):
    """SGLang counts cached_tokens once (retracted_stain): a retract and re-prefill leave the number as it was."""
    ids = BASE[800:860]
    run(engine, [req("seed", ids)])
    fired = []

    def on_step(r):
        if len(r.output_ids) == 2 and not fired:
            fired.append(1)
            engine.pause("retract")
            engine.resume()

    r, = run(engine, [req("retracted", ids + [9], max_new_tokens=8, temperature=1.0, sampling_seed=6)], on_step)
    assert fired and r.cached_tokens == len(ids) and len(r.output_ids) == 8
    assert torch.allclose(out_lps(r), ref_logprobs(hf_models["v0"], r.input_ids, r.output_ids, 1.0), atol=1e-4)
    assert engine.prefix_cache.protected_tokens == 0
