"""The embedded server's pure request/response module and sampling processors, without a model."""
import base64

import numpy as np
import pytest
import torch

from mega_async.server.engine import GenRequest
from mega_async.server.generate_protocol import (GenerateLimits, Options, check_text, meta_info,
                                                           output_text, parse_generate, parse_sampling, prompt_items,
                                                           version_spans)
from mega_async.server.protocol import ContractError, ValueRejected, error_body
from mega_async.server.routing import encode_routes
from mega_async.server.sampling import process_logits, sample_full

LIM = GenerateLimits(vocab_size=100, max_context=64, max_new_tokens_cap=1 << 16, tokenizer=None, max_token_chars=4)


@pytest.mark.parametrize("sp, err, needle", [
    ({"max_tokens": 2}, ContractError, "unknown field `max_tokens`, expected one of `max_new_tokens`"),
    ({"ignore_eos": "false"}, ContractError, 'invalid type: string "false", expected a boolean'),
    ({"temperature": float("nan")}, ValueRejected, "temperature must be a finite number"),
    ({"temperature": "1"}, ContractError, 'invalid type: string "1", expected f64'),
    ({"top_p": 0}, ValueRejected, "top_p must be in (0, 1]"),
    ({"regex": "a+"}, ValueRejected, "regex is not supported"),
    ({"json_schema": "{}"}, ValueRejected, "json_schema is not supported"),
    ({"min_new_tokens": 9, "max_new_tokens": 4}, ValueRejected, "min_new_tokens must be in [0, max_new_tokens(4)]"),
    ({"n": 0}, ValueRejected, "n must be at least 1"),
    ({"logit_bias": {"x": 1}}, ValueRejected, "logit_bias keys must be token ids"),
])
def test_sampling_params_follow_sglang_contract(sp, err, needle):
    with pytest.raises(err) as e:
        parse_sampling(sp)
    assert needle in str(e.value)
    body = error_body(e.value)
    assert (body == {"error": str(e.value)}) if err is ContractError else (body["error"]["message"] == str(e.value))


def test_parse_expands_n_and_batches_with_sglang_rids():
    body = {"input_ids": [[1, 2], [3, 4, 5]], "rid": "r", "sampling_params": {"n": 2, "max_new_tokens": 3},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    items, is_batch = prompt_items(body)
    reqs = parse_generate(body, items, is_batch, LIM)
    assert [r.rid for r, _ in reqs] == ["r-0", "r-1", "r-2", "r-3"]
    assert [r.input_ids for r, _ in reqs] == [[1, 2], [1, 2], [3, 4, 5], [3, 4, 5]]
    assert all(r.top_logprobs_num == 2 and r.logprob_start_len == 0 and o.return_logprob for r, o in reqs)
    with pytest.raises(ValueRejected, match="--enable-return-routed-experts"):
        parse_generate({"input_ids": [1, 2], "return_routed_experts": True, "sampling_params": {"max_new_tokens": 3}},
                       [[1, 2]], False, LIM)
    with pytest.raises(ContractError, match="expected a boolean"):
        parse_generate({"input_ids": [1, 2], "return_logprob": "false", "sampling_params": {"max_new_tokens": 3}},
                       [[1, 2]], False, LIM)
    with pytest.raises(ValueRejected, match="context length"):
        parse_generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 63}}, [[1, 2]], False, LIM)


def test_long_text_is_refused_before_tokenizing():
    lim = GenerateLimits(100, 64, 1 << 16, tokenizer=object(), max_token_chars=4)
    check_text("x" * 256, lim)  # could still fit
    with pytest.raises(ValueRejected, match="longer than the context length"):
        check_text("x" * 257, lim)


def test_weight_version_spans_and_meta():
    assert version_spans(["1", "1", "2", "2", "2"], "3") == [{"version": "1", "start": 0, "end": 2},
                                                            {"version": "2", "start": 2, "end": 5}]
    assert version_spans([], "3") == [{"version": "3", "start": 0, "end": 0}]
    r = GenRequest(rid="a", input_ids=[1, 2, 3], output_ids=[4, 5], output_logprobs=[-0.5, -1.0],
                   output_versions=["0", "1"], finish_reason={"type": "length", "length": 2})
    m = meta_info(r, Options(return_logprob=True), "1", 0.1, None)
    assert m["weight_version"] == "1" and len(m["weight_versions"]) == 2
    assert m["output_token_logprobs"] == [[-0.5, 4, None], [-1.0, 5, None]] and m["input_token_logprobs"] == []


class _Tok:
    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        return "".join({4: "ab", 5: "STOP", 6: "cd", 0: "<eos>"}[i] for i in ids)


def test_stop_trimming_and_no_stop_trim():
    r = GenRequest(rid="a", input_ids=[1], output_ids=[4, 5, 6], finish_reason={"type": "stop", "matched": "STOP"})
    assert output_text(r, Options(), _Tok()) == "ab"
    assert output_text(r, Options(no_stop_trim=True), _Tok()) == "abSTOPcd"
    r = GenRequest(rid="a", input_ids=[1], output_ids=[4, 0], finish_reason={"type": "stop", "matched": 0})
    assert output_text(r, Options(), _Tok()) == "ab" and output_text(r, Options(no_stop_trim=True), _Tok()) == "ab<eos>"


def test_routed_experts_encoding_is_sglangs():
    routes = torch.tensor([[[1, 2], [3, 0]], [[7, 6], [5, 4]], [[0, 1], [2, 3]]])  # [tokens, layers, k]
    back = np.frombuffer(base64.b64decode(encode_routes(routes).encode("ascii")), dtype=np.int32).reshape(3, 2, 2)
    assert back.tolist() == routes.tolist()


def _req(**kw):
    return GenRequest(rid="x", input_ids=[1], **kw)


def test_penalties_bias_and_min_new_tokens():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    out = process_logits(logits.clone(), [_req(output_ids=[1, 1, 2], frequency_penalty=0.5)], set())
    assert torch.allclose(out, torch.tensor([[1.0, 1.0, -1.5, 0.5]]))
    out = process_logits(logits.clone(), [_req(output_ids=[1, 2], presence_penalty=0.25)], set())
    assert torch.allclose(out, torch.tensor([[1.0, 1.75, -1.25, 0.5]]))
    out = process_logits(logits.clone(), [_req(output_ids=[1, 2], repetition_penalty=2.0)], set())
    assert torch.allclose(out, torch.tensor([[1.0, 1.0, -2.0, 0.5]]))  # positive / p, negative * p
    out = process_logits(logits.clone(), [_req(logit_bias={3: 10.0})], set())
    assert torch.allclose(out, torch.tensor([[1.0, 2.0, -1.0, 10.5]]))
    out = process_logits(logits.clone(), [_req(min_new_tokens=2, stop_token_ids={3})], {1})
    assert out[0, 1] == float("-inf") and out[0, 3] == float("-inf") and out[0, 0] == 1.0


def test_sampling_seed_makes_rows_reproducible():
    logits = torch.randn(3, 50)
    g = [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(7)]
    a, _, _ = sample_full(logits, [1.0] * 3, [-1] * 3, [1.0] * 3, torch.Generator().manual_seed(0), generators=g)
    g2 = [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(8)]
    b, _, _ = sample_full(logits, [1.0] * 3, [-1] * 3, [1.0] * 3, torch.Generator().manual_seed(1), generators=g2)
    assert a[0] == b[0]  # same seed, same draw, whatever the batch generator did
    outs = {int(sample_full(logits[:1], [1.0], [-1], [1.0], generators=[torch.Generator().manual_seed(s)])[0])
            for s in range(20)}
    assert len(outs) > 3  # different seeds draw differently


# ---- SGLang's request models (issue 25.1) --------------------------------------------------------------
LAX_INPUTS = [True, False, 0, 1, 2, -3, 29500, 2 ** 70, 1.0, 1.5, -3.0, 0.0, 2.0 ** 62, 2.0 ** 63, -2.0 ** 63, 1e19,
              float("inf"), float("nan"), "1", "29500", " 7 ", "\t5\n", "+5", "-0", "1.0", "1.00", "-2.000", "1.50",
              "1.", ".0", "1e3", "1_000", "1_0.0", "1.0_0", "_1", "1__0", "0x10", "0b1", "00012", "", " ", "9" * 30,
              "true", "True", "TRUE", "tRuE", " true", "false", "OFF", "on", "yes", "no", "y", "n", "t", "f", "abort",
              "١٢", None, [], [1], {}, {"a": 1},
              # over 4300 characters: pydantic's own size error where its number parser sees the digits first
              "1" * 4300, "1" * 4301, "-" + "1" * 4300, "9" * 5000 + "x", "1" * 4301 + ".0", " " + "1" * 4301,
              "+" + "1" * 4301, "0" * 5000 + "1", "-" + "0" * 6000, "0" + "1" * 4301, "1" * 4300 + "_1",
              # the sign is not a digit (pydantic 2.14; 2.13 counted it): 4300 digits with a sign are an integer
              "-" + "1" * 4300, "-" + "1" * 4301, "-0" + "1" * 4300, "-" + "1" * 4300 + ".0", "+" + "1" * 4300]


@pytest.mark.parametrize("kind", ["int", "bool", "str"])
def test_lax_coercions_are_pydantics(kind):
    """SGLang validates its control requests with pydantic in lax mode; ours give the same value or refuse the
    same inputs, compared against pydantic itself: the test extra admits only the pydantic releases whose rules
    ours follow (setup.py: pydantic>=2.14), so a fresh install cannot bring a reference that disagrees."""
    pydantic = pytest.importorskip("pydantic")
    assert tuple(int(x) for x in pydantic.VERSION.split(".")[:2]) >= (2, 14), pydantic.VERSION
    from mega_async.server.protocol import FieldError, lax_bool, lax_int, lax_str

    ours = {"int": lax_int, "bool": lax_bool, "str": lax_str}[kind]
    ref = pydantic.TypeAdapter({"int": int, "bool": bool, "str": str}[kind])
    for v in LAX_INPUTS:
        try:
            want = ("ok", ref.validate_python(v))
        except pydantic.ValidationError as e:
            want = ("refused", e.errors()[0]["msg"])
        try:
            got = ("ok", ours(v))
        except FieldError as e:
            got = ("refused", str(e))
        assert got == want and type(got[1]) is type(want[1]), (kind, v)


def test_areal_and_slime_control_bodies_validate_as_sglang():
    """AReaL's own calls (sglang_remote.py): master_port as a string, the disk update's misspelt
    abort_all_request (SGLang ignores unknown keys); other frameworks' booleans as strings; the one-line refusals."""
    from mega_async.server.protocol import BadRequest, validate_request

    areal_init = {"master_address": "127.0.0.1", "master_port": str(29500), "rank_offset": 1, "world_size": 2,
                  "backend": "nccl", "group_name": "update_weight_group"}
    out = validate_request("/init_weights_update_group", areal_init)
    assert out["master_port"] == 29500 and out["rank_offset"] == 1 and out["backend"] == "nccl"
    out = validate_request("/update_weights_from_disk", {"model_path": "/w/v1", "abort_all_request": True})
    assert out["abort_all_requests"] is False and out["flush_cache"] is True and out["abort_all_request"] is True
    out = validate_request("/update_weights_from_distributed", {
        "names": ["w"], "dtypes": ["bfloat16"], "shapes": [(2, "3")], "group_name": "g", "abort_all_requests": "true"})
    assert out["shapes"] == [[2, 3]] and out["abort_all_requests"] is True and out["selector"] == "all"
    assert validate_request("/pause_generation", {})["mode"] == "abort"
    assert validate_request("/abort_request", {"rid": "r1", "abort_all": 0})["abort_all"] is False
    assert validate_request("/begin_weight_update", {})["selector"] == "all"  # BeginWeightUpdateReqInput
    assert validate_request("/end_weight_update", {"rid": "r7"})["rid"] == "r7"
    out = validate_request("/weights_checker", {"allow_quant_error": "true", "skip_tensor_list": None})
    assert out["action"] == "checksum" and out["allow_quant_error"] is True and out["selector"] == "all"
    for path, body, needle in [
        ("/init_weights_update_group", {**areal_init, "master_port": "port"},
         "master_port: Input should be a valid integer, unable to parse string as an integer (got 'port')"),
        ("/init_weights_update_group", {"master_address": "h", "rank_offset": 1, "world_size": 2},
         "master_port: Field required"),
        ("/update_weight_version", {"new_version": 3}, "new_version: Input should be a valid string (got 3)"),
        ("/pause_generation", {"mode": "later"}, "mode: Input should be 'abort', 'retract' or 'in_place'"),
        ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"], "shapes": [[1.5]]},
         "shapes: [0]: [0]: Input should be a valid integer, got a number with a fractional part"),
        ("/update_weights_from_disk", {"model_path": "/w", "flush_cache": None}, "flush_cache: Input should be a "
         "valid boolean"),
        ("/begin_weight_update", {"selector": "both"}, "selector: Input should be 'target', 'draft' or 'all'"),
        ("/weights_checker", {"skip_tensor_list": "a"}, "skip_tensor_list"),
    ]:
        with pytest.raises(BadRequest) as e:
            validate_request(path, body)
        assert needle in str(e.value), str(e.value)


def test_openai_scalars_coerce_as_sglangs_pydantic_models():
    from mega_async.server.protocol import BadRequest, validate_openai

    out = validate_openai("/v1/chat/completions", {"messages": [], "max_tokens": "8", "top_p": "0.9", "n": 2.0,
                                                   "logprobs": "true", "stop_token_ids": ["7"]})
    assert out == {"messages": [], "max_tokens": 8, "top_p": 0.9, "n": 2, "logprobs": True, "stop_token_ids": [7]}
    assert validate_openai("/v1/completions", {"prompt": "x"}) == {"prompt": "x"}  # defaults stay the server's
    with pytest.raises(BadRequest, match="temperature: Input should be a valid number, unable to parse string"):
        validate_openai("/v1/completions", {"prompt": "x", "temperature": "warm"})


# ---- bounded work per body (issue 18, "Also") ------------------------------------------------------------
def test_n_samples_share_one_checked_prompt_and_the_body_is_bounded():
    """n samples of a 2000-token prompt: one check of the prompt and one token list shared by every sample (the
    old parse copied and re-checked it n times: n = 10^4 took 6.5 s and 400 MB on the event loop); prompts x n
    past --max-requests-per-body is one 400 before anything is built."""
    import tracemalloc

    lim = GenerateLimits(vocab_size=1000, max_context=4096, max_new_tokens_cap=1 << 16, max_requests_per_body=2048)
    prompt = [1 + i % 999 for i in range(2000)]
    body = {"input_ids": prompt, "sampling_params": {"n": 2048, "max_new_tokens": 8}}
    tracemalloc.start()
    try:
        reqs = parse_generate(body, [prompt], False, lim)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(reqs) == 2048 and all(r.input_ids is prompt for r, _ in reqs)
    assert peak < 16 << 20, peak  # copies alone would be 2048 x 16 KB = 32 MB
    for body, items in [({"input_ids": prompt, "sampling_params": {"n": 2049}}, [prompt]),
                        ({"input_ids": [[1, 2]] * 1025, "sampling_params": {"n": 2}}, [[1, 2]] * 1025)]:
        with pytest.raises(ValueRejected, match="more than this server's limit of 2048 per request "
                                                r"\(--max-requests-per-body\)"):
            parse_generate(body, items, True, lim)


def test_stop_strings_are_bounded_as_sglang_and_by_total_length():
    from mega_async.server.generate_protocol import MAX_STOP_CHARS

    assert len(parse_sampling({"stop": ["a"] * 32})["stop"]) == 32
    with pytest.raises(ValueRejected, match="^at most 32 stop strings are allowed, got 33$"):  # SGLang 0.5.23's
        parse_sampling({"stop": ["a"] * 33})
    parse_sampling({"stop": ["x" * (MAX_STOP_CHARS - 1), "y"]})
    with pytest.raises(ValueRejected, match=f"{MAX_STOP_CHARS + 1} characters of stop strings, more than the "
                                            f"{MAX_STOP_CHARS}"):
        parse_sampling({"stop": "x" * (MAX_STOP_CHARS + 1)})


def test_logit_bias_and_stop_ids_cost_one_build_not_one_a_step():
    """logit_bias keys outside the vocabulary are SGLang's 400; stop ids outside it are dropped; a bias over the
    whole vocabulary is turned into tensors once for all n samples, not rebuilt from Python every decode step
    (the old processor iterated the bias tensor element by element each step)."""
    lim = GenerateLimits(vocab_size=100, max_context=64, max_new_tokens_cap=1 << 16)
    with pytest.raises(ValueRejected, match=r"^logit_bias must has keys in \[0, 99\], got 100\.$"):
        parse_generate({"input_ids": [1], "sampling_params": {"logit_bias": {"100": 1.0}}}, [[1]], False, lim)
    body = {"input_ids": [1], "sampling_params": {"n": 3, "max_new_tokens": 4, "min_new_tokens": 2,
                                                  "logit_bias": {str(t): 0.5 for t in range(100)},
                                                  "stop_token_ids": [5, 10 ** 12]}}
    reqs = [r for r, _ in parse_generate(body, [[1]], False, lim)]
    assert reqs[0].stop_token_ids == {5} and all(r.sampling_cache is reqs[0].sampling_cache for r in reqs)
    logits = torch.zeros(3, 100)
    out = process_logits(logits, reqs, {7})
    assert torch.equal(out[:, 5], torch.full((3,), float("-inf"))) and out[0, 0] == 0.5 and out[2, 99] == 0.5
    built = dict(reqs[0].sampling_cache)
    assert set(built) == {"bias", "min_new_stops"}
    process_logits(torch.zeros(3, 100), reqs, {7})
    assert all(reqs[0].sampling_cache[k] is built[k] for k in built)  # not rebuilt on the next step


def test_top_logprobs_are_bounded_per_body():
    """top_logprobs_num x tokens x samples is what the server keeps and sends: the whole vocabulary for 32k
    tokens (one small body) would be billions of entries; past 2^24 it is one 400 (SGLang has no bound)."""
    from mega_async.server.generate_protocol import MAX_TOP_LOGPROB_ENTRIES

    lim = GenerateLimits(vocab_size=1 << 17, max_context=1 << 16, max_new_tokens_cap=1 << 16)
    ok = {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 20,
          "sampling_params": {"max_new_tokens": 4096, "n": 16}}
    parse_generate(ok, [[1, 2]], False, lim)
    huge = {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 1 << 17, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 32000}}
    with pytest.raises(ValueRejected, match=f"asks {(1 << 17) * 32002} top-logprob entries, more than this "
                                            f"server's {MAX_TOP_LOGPROB_ENTRIES}"):
        parse_generate(huge, [[1, 2]], False, lim)
    parse_generate({**huge, "return_logprob": False}, [[1, 2]], False, lim)  # not asked: nothing kept
