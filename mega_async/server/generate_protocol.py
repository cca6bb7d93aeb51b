"""SGLang's /generate wire format, pure: body -> engine requests, finished request -> response JSON. No I/O.

Follows SGLang 0.5.23: sampling_params keys outside SGLang's schema, and values of the wrong JSON type
(the string "false" for a boolean), are contract errors (`{"error": "unknown field ..."}`); values SGLang
refuses (temperature NaN, top_p 0) and features this server does not implement (regex, json_schema, ...)
are `{"error": {"message": ...}}`. Both are 400, never a silent 200.
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from mega_async.server.engine import GenRequest
from mega_async.server.protocol import ContractError, ValueRejected
from mega_async.server.routing import encode_routes

# SGLang's SamplingParams schema (sglang/api/v1/api_types.py), in its order
SAMPLING_KEYS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
                 "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                 "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
                 "custom_params", "beam_width", "watermark", "choice")
NOT_IMPLEMENTED = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "beam_width", "watermark", "choice")
TOP_NOT_IMPLEMENTED = ("return_hidden_states", "lora_path", "session_params", "image_data",
                       "video_data", "audio_data", "bootstrap_host", "return_sampling_mask")
# SGLang's tokenizer manager, word for word, when --enable-custom-logit-processor is off
CUSTOM_LOGIT_PROCESSOR_OFF = ("The server is not configured to enable custom logit processor. Please set "
                              "`--enable-custom-logit-processor` to enable this feature.")
CUSTOM_LOGIT_PROCESSOR_ON = ("custom_logit_processor is not run by the embedded server even with "
                             "--enable-custom-logit-processor: it is a pickled Python callable (dill) and this server "
                             "unpickles nothing; send it to a real SGLang server")
FLOATS = {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
          "repetition_penalty": 1.0}
INTS = {"max_new_tokens": 128, "top_k": -1, "min_new_tokens": 0, "n": 1, "stream_interval": 1, "sampling_seed": None}
BOOLS = {"ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False}
TOP_K_ALL = 1 << 30  # SGLang's default top_k: no truncation
MAX_STOP_COUNT = 32  # SGLang 0.5.20+ (sampling_params.py)
MAX_STOP_CHARS = 4096  # this server's: characters of all stop strings of a request together
MAX_TOP_LOGPROB_ENTRIES = 1 << 24  # this server's: top_logprobs_num x scored tokens x samples of a body (~2 GB)


@dataclass(frozen=True)
class GenerateLimits:
    vocab_size: int
    max_context: int
    max_new_tokens_cap: int
    tokenizer: Any = None
    max_token_chars: int = 64  # longest vocabulary entry in characters: bounds a text's token count from below
    max_requests_per_body: int = 1 << 14  # prompts x n of one body (SGLang has no such bound; see docs/security.md)


@dataclass
class Options:
    """What a response carries besides tokens (per request)."""
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int = 1
    routed_experts_start_len: int = 0
    extra: dict = field(default_factory=dict)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _unexpected(v: Any) -> str:
    """serde's `Unexpected` display, as SGLang's contract errors print it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def _expect(ok: bool, v: Any, what: str, key: str) -> None:
    if not ok:
        raise ContractError(f"invalid type: {_unexpected(v)}, expected {what} (sampling_params.{key})")


def _top_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ContractError(f"invalid type: {_unexpected(v)}, expected a boolean ({key})")
    return v


def _top_int(body: dict, key: str, default: int) -> int:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise ContractError(f"invalid type: {_unexpected(v)}, expected i64 ({key})")
    return v


def parse_sampling(sp: Any) -> dict:
    """A sampling_params object checked against SGLang's schema and value rules -> plain values."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise ContractError(f"invalid type: {_unexpected(sp)}, expected struct SamplingParams")
    unknown = [k for k in sp if k not in SAMPLING_KEYS]
    if unknown:
        listed = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
        raise ContractError(f"unknown field `{unknown[0]}`, expected one of {listed}")
    out: dict = {}
    for k, d in FLOATS.items():
        v = sp.get(k)
        _expect(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)), v, "f64", k)
        out[k] = d if v is None else float(v)
        if not math.isfinite(out[k]):
            raise ValueRejected(f"sampling_params.{k} must be a finite number, got {v}")
    for k, d in INTS.items():
        v = sp.get(k)
        _expect(v is None or _is_int(v), v, "i64", k)
        out[k] = d if v is None else v
    for k, d in BOOLS.items():
        v = sp.get(k)
        _expect(v is None or isinstance(v, bool), v, "a boolean", k)
        out[k] = d if v is None else v
    for k in NOT_IMPLEMENTED:
        if sp.get(k) not in (None, [], {}, ""):
            raise ValueRejected(f"sampling_params.{k} is not supported by the embedded server (send it to a real "
                                "SGLang server, or leave it out)")
    stop = sp.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    _expect(isinstance(stop, list) and all(isinstance(s, str) for s in stop), sp.get("stop"), "a string or a list "
            "of strings", "stop")
    ids = sp.get("stop_token_ids") or []
    _expect(isinstance(ids, list) and all(_is_int(t) for t in ids), ids, "a sequence of i64", "stop_token_ids")
    bias = sp.get("logit_bias") or {}
    _expect(isinstance(bias, dict), bias, "a map", "logit_bias")
    out["logit_bias"] = _logit_bias(bias)
    _check_stops(stop)
    out["stop"], out["stop_token_ids"] = [s for s in stop if s], set(ids)
    out["custom_params"] = sp.get("custom_params")  # any JSON (SGLang's schema: Optional[Any]), passed through
    _check_values(out)
    return out


def _check_stops(stop: list[str]) -> None:
    """SGLang 0.5.20+'s bound on their number (its message), and this server's on their total length: the
    per-token check searches the output's tail as long as the longest one (SGLang bounds no length)."""
    if len(stop) > MAX_STOP_COUNT:
        raise ValueRejected(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stop)}")
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_CHARS:
        raise ValueRejected(f"sampling_params.stop: {total} characters of stop strings, more than the "
                            f"{MAX_STOP_CHARS} this server allows a request; use shorter stop strings")


def _logit_bias(bias: dict) -> dict[int, float]:
    res = {}
    for k, v in bias.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise ValueRejected(f"sampling_params.logit_bias keys must be token ids, got {k!r}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueRejected(f"sampling_params.logit_bias[{k!r}] must be a finite number, got {v!r}")
        res[tok] = float(v)
    return res


def _check_values(p: dict) -> None:
    """SGLang's SamplingParams.verify, message for message where it has one."""
    if p["temperature"] < 0.0:
        raise ValueRejected(f"temperature must be non-negative, got {p['temperature']}.")
    if not 0.0 < p["top_p"] <= 1.0:
        raise ValueRejected(f"top_p must be in (0, 1], got {p['top_p']}.")
    if not 0.0 <= p["min_p"] <= 1.0:
        raise ValueRejected(f"min_p must be in [0, 1], got {p['min_p']}.")
    if p["top_k"] < 1 and p["top_k"] != -1:
        raise ValueRejected(f"top_k must be -1 (disable), or at least 1, got {p['top_k']}.")
    if not -2.0 <= p["frequency_penalty"] <= 2.0:
        raise ValueRejected(f"frequency_penalty must be in [-2, 2], got {p['frequency_penalty']}.")
    if not -2.0 <= p["presence_penalty"] <= 2.0:
        raise ValueRejected(f"presence_penalty must be in [-2, 2], got {p['presence_penalty']}.")
    if not 0.0 < p["repetition_penalty"] <= 2.0:
        raise ValueRejected(f"repetition_penalty must be in (0, 2], got {p['repetition_penalty']}.")
    if p["max_new_tokens"] < 0:
        raise ValueRejected(f"max_new_tokens must be at least 0, got {p['max_new_tokens']}.")
    if not 0 <= p["min_new_tokens"] <= p["max_new_tokens"]:
        raise ValueRejected(f"min_new_tokens must be in [0, max_new_tokens({p['max_new_tokens']})], got "
                            f"{p['min_new_tokens']}.")
    if p["n"] < 1:
        raise ValueRejected(f"n must be at least 1, got {p['n']}.")
    if p["stream_interval"] < 1:
        raise ValueRejected(f"stream_interval must be at least 1, got {p['stream_interval']}.")


# ---- prompts -----------------------------------------------------------------------------------
def prompt_items(body: dict) -> tuple[list[Any], bool]:
    """The prompts of a body (token lists or strings) and whether it was a batch. input_ids wins over text."""
    ids, text = body.get("input_ids"), body.get("text")
    src = ids if ids is not None else text
    if src is None:
        raise ValueRejected("Either text or input_ids should be provided.")
    if isinstance(src, list) and src and isinstance(src[0], (list, str)):
        return list(src), True
    return [src], False


def check_text(text: Any, lim: GenerateLimits) -> None:
    """Cheap checks before tokenizing: a string, a tokenizer, and not surely longer than the context."""
    if not isinstance(text, str):
        raise ContractError(f"invalid type: {_unexpected(text)}, expected a string (text)")
    if lim.tokenizer is None:
        raise ValueRejected("this server has no tokenizer: send input_ids")
    if len(text) > lim.max_context * lim.max_token_chars:
        raise ValueRejected(f"text of {len(text)} characters is longer than the context length {lim.max_context} "
                            f"tokens can hold (at most {lim.max_token_chars} characters a token)")


def check_ids(ids: Any, lim: GenerateLimits) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(_is_int(t) for t in ids):
        raise ValueRejected("input_ids must be a non-empty list of integers")
    bad = next((t for t in ids if not 0 <= t < lim.vocab_size), None)
    if bad is not None:
        raise ValueRejected(f"input_ids contain token id {bad} outside [0, {lim.vocab_size})")
    return ids


def _token_ids_logprob(body: dict, i: int, vocab: Optional[int]) -> Optional[list[int]]:
    """SGLang's `token_ids_logprob`: one list of token ids for every prompt, or one list per prompt."""
    v = body.get("token_ids_logprob")
    if v is None:
        return None
    if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
        if i >= len(v):
            raise ValueRejected(f"token_ids_logprob has {len(v)} lists, fewer than the prompts")
        v = v[i]
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ValueRejected(f"token_ids_logprob must be a list of token ids (or one per prompt), got {v!r}"[:200])
    bad = [x for x in v if x < 0 or (vocab is not None and x >= vocab)]
    if bad:
        raise ValueRejected(f"token_ids_logprob: token id {bad[0]} is outside the vocabulary (0..{vocab})")
    return list(v)


def _per_prompt(body: dict, key: str, i: int) -> Any:
    v = body.get(key)
    return v[i] if isinstance(v, list) and key != "input_ids" else v


def parse_generate(body: dict, prompts: list[list[int]], is_batch: bool, lim: GenerateLimits,
                   routed_experts_enabled: bool = False,
                   custom_logit_processor_enabled: bool = False) -> list[tuple[GenRequest, Options]]:
    """A /generate body with its prompts tokenized -> one (request, options) per prompt and sample (i * n + j)."""
    for k in TOP_NOT_IMPLEMENTED:
        if body.get(k) not in (None, False, [], {}):
            raise ValueRejected(f"{k} is not supported by the embedded server")
    clp = body.get("custom_logit_processor")
    if clp not in (None, "", []) and not (isinstance(clp, list) and all(x in (None, "") for x in clp)):
        raise ValueRejected(CUSTOM_LOGIT_PROCESSOR_ON if custom_logit_processor_enabled else CUSTOM_LOGIT_PROCESSOR_OFF)
    sps = body.get("sampling_params")
    if isinstance(sps, list) and len(sps) != len(prompts):
        raise ValueRejected(f"{len(sps)} sampling_params for {len(prompts)} prompts")
    rid = body.get("rid")
    if isinstance(rid, list) and len(rid) != len(prompts):
        raise ValueRejected(f"{len(rid)} rids for {len(prompts)} prompts")
    shared = None if isinstance(sps, list) else _in_vocab(parse_sampling(sps), lim)  # one for every prompt
    per_prompt = []  # (request fields, options fields, n) of each prompt: every prompt is checked once, not n times
    for i, ids in enumerate(prompts):
        sp = shared if shared is not None else _in_vocab(parse_sampling(sps[i]), lim)
        per_prompt.append(_prompt_fields(body, i, check_ids(ids, lim), sp, lim, routed_experts_enabled))
    total = sum(n for _, _, n in per_prompt)
    entries = sum(n * f["top_logprobs_num"] * (f["max_new_tokens"] + (len(f["input_ids"]) - f["logprob_start_len"]
                                                                      if f["logprob_start_len"] >= 0 else 0))
                  for f, _, n in per_prompt)
    if entries > MAX_TOP_LOGPROB_ENTRIES:
        raise ValueRejected(f"top_logprobs_num over this body's tokens and samples asks {entries} top-logprob "
                            f"entries, more than this server's {MAX_TOP_LOGPROB_ENTRIES} a request (each is kept "
                            "and sent): ask fewer top logprobs, tokens or samples")
    if total > lim.max_requests_per_body:
        raise ValueRejected(f"this body asks {total} generations (prompts x sampling_params.n), more than this "
                            f"server's limit of {lim.max_requests_per_body} per request (--max-requests-per-body): "
                            "send them in several requests")
    out = []
    base = uuid.uuid4().int  # no rid: a uuid4 for the first request, the next ones counted from it (one draw)
    for i, (req_fields, opt_fields, n) in enumerate(per_prompt):
        for j in range(n):  # the n samples share the prompt's token list (nothing writes to input_ids)
            r = f"{(base + len(out)) % (1 << 128):032x}" if rid is None else _rid(rid, i, j, i * n + j, is_batch, n)
            out.append((GenRequest(rid=r, **req_fields), Options(**opt_fields)))
    return out


def _in_vocab(sp: dict, lim: GenerateLimits) -> dict:
    """SGLang's check of logit_bias keys (its message); stop_token_ids outside the vocabulary can never be
    sampled and are dropped (SGLang keeps them, to no effect), so neither holds more than the vocabulary."""
    bad = next((t for t in sp["logit_bias"] if not 0 <= t < lim.vocab_size), None)
    if bad is not None:
        raise ValueRejected(f"logit_bias must has keys in [0, {lim.vocab_size - 1}], got {bad}.")
    if any(not 0 <= t < lim.vocab_size for t in sp["stop_token_ids"]):
        sp["stop_token_ids"] = {t for t in sp["stop_token_ids"] if 0 <= t < lim.vocab_size}
    sp["sampling_cache"] = {}  # their tensors, built once for every request sampled with these params
    return sp


def _rid(rid: Any, i: int, j: int, k: int, is_batch: bool, n: int) -> str:
    if isinstance(rid, list):
        return str(rid[i]) if n == 1 else f"{rid[i]}-{j}"
    return str(rid) if not is_batch and n == 1 else f"{rid}-{k}"


def _prompt_fields(body: dict, i: int, ids: list[int], sp: dict, lim: GenerateLimits,
                   routed: bool) -> tuple[dict, dict, int]:
    """One prompt's checks, and the fields of its GenRequests and Options (all but the rid) and its n."""
    max_new = sp["max_new_tokens"]
    if max_new > lim.max_new_tokens_cap or len(ids) + max_new > lim.max_context:
        raise ValueRejected(f"The input ({len(ids)} tokens) plus max_new_tokens ({max_new}) is longer than the "
                            f"model's context length ({lim.max_context} tokens).")
    ret_lp = _top_bool({"return_logprob": _per_prompt(body, "return_logprob", i)}, "return_logprob")
    start = _top_int({"logprob_start_len": _per_prompt(body, "logprob_start_len", i)}, "logprob_start_len", -1)
    top_n = _top_int({"top_logprobs_num": _per_prompt(body, "top_logprobs_num", i)}, "top_logprobs_num", 0)
    want_routes = _top_bool(body, "return_routed_experts")
    if want_routes and not routed:
        raise ValueRejected("return_routed_experts requires the server to be started with "
                            "--enable-return-routed-experts")
    if start > len(ids):  # SGLang's scheduler message; == len asks no prompt logprobs (SGLang's default)
        raise ValueRejected(f"req.logprob_start_len={start} is higher than the number of input tokens "
                            f"len(req.origin_input_ids)={len(ids)}. Please use a smaller logprob_start_len.")
    if start == len(ids):
        start = -1
    if top_n < 0:
        raise ValueRejected(f"top_logprobs_num must be at least 0, got {top_n}")
    ids_lp = _token_ids_logprob(body, i, lim.vocab_size)
    req = dict(
        input_ids=ids, max_new_tokens=max_new, temperature=sp["temperature"], top_p=sp["top_p"],
        top_k=-1 if sp["top_k"] >= TOP_K_ALL else sp["top_k"], stop_token_ids=sp["stop_token_ids"], stop=sp["stop"],
        ignore_eos=sp["ignore_eos"], min_p=sp["min_p"], min_new_tokens=sp["min_new_tokens"],
        frequency_penalty=sp["frequency_penalty"], presence_penalty=sp["presence_penalty"],
        repetition_penalty=sp["repetition_penalty"], logit_bias=sp["logit_bias"], sampling_seed=sp["sampling_seed"],
        logprob_start_len=start if ret_lp else -1, top_logprobs_num=top_n if ret_lp else 0,
        token_ids_logprob=ids_lp if ret_lp else None, return_routed_experts=want_routes, sampling_cache=sp["sampling_cache"])
    opts = dict(return_logprob=ret_lp, return_text_in_logprobs=_top_bool(body, "return_text_in_logprobs"),
                skip_special_tokens=sp["skip_special_tokens"],
                spaces_between_special_tokens=sp["spaces_between_special_tokens"], no_stop_trim=sp["no_stop_trim"],
                stream_interval=sp["stream_interval"],
                routed_experts_start_len=_top_int(body, "routed_experts_start_len", 0),
                extra={"custom_params": sp["custom_params"]} if sp["custom_params"] is not None else {})
    return req, opts, sp["n"]


# ---- responses ---------------------------------------------------------------------------------
def version_spans(versions: list[str], current: str) -> list[dict]:
    """SGLang's meta_info.weight_versions: [{version, start, end}] over the output tokens, in order."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans or [{"version": current, "start": 0, "end": 0}]


def output_text(req: GenRequest, opts: Options, tokenizer: Any) -> str:
    """The decoded output, with a matched stop token or string trimmed unless no_stop_trim (SGLang's rule)."""
    if tokenizer is None:
        return ""
    ids = req.output_ids
    matched = (req.finish_reason or {}).get("matched")
    trim = not opts.no_stop_trim and (req.finish_reason or {}).get("type") == "stop"
    if trim and isinstance(matched, int) and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=opts.skip_special_tokens,
                            spaces_between_special_tokens=opts.spaces_between_special_tokens)
    if trim and isinstance(matched, str) and matched in text:
        text = text[:text.index(matched)]
    return text


def _lp_entries(lps: list, ids: list[int], with_text: bool, tokenizer: Any) -> list:
    return [[lp, t, tokenizer.decode([t]) if with_text and tokenizer is not None else None] for lp, t in zip(lps, ids)]


def _top_entries(tops: list, with_text: bool, tokenizer: Any) -> list:
    return [None if row is None else _lp_entries([lp for lp, _ in row], [t for _, t in row], with_text, tokenizer)
            for row in tops]


def meta_info(req: GenRequest, opts: Options, current_version: str, latency: float, tokenizer: Any) -> dict:
    """meta_info of a (possibly partial) request, SGLang's keys."""
    fr = dict(req.finish_reason) if req.finish_reason else None
    waiting_abort = (fr or {}).get("message") == "Abort in waiting queue"
    spans = version_spans(req.output_versions, current_version)
    meta = {
        "id": req.rid, "finish_reason": fr,
        "prompt_tokens": 0 if waiting_abort else len(req.input_ids),
        "completion_tokens": len(req.output_ids), "cached_tokens": req.cached_tokens,
        "weight_version": spans[-1]["version"], "weight_versions": spans, "e2e_latency": latency,
        # SGLang 0.5.23's other keys, as its CPU engine answers them here (no reasoning parser, one DP rank)
        "num_retractions": req.num_retractions, "reasoning_tokens": 0, "cached_tokens_details": None,
        "dp_rank": None, "response_sent_to_client_ts": time.time(),
    }
    if fr is not None and fr.get("type") == "abort" and "status_code" not in fr:  # an abort asked for (pause,
        fr.update(status_code=None, err_type=None)  # /abort_request): SGLang's FINISH_ABORT.to_json, both null
    if opts.return_logprob:
        t = opts.return_text_in_logprobs
        meta["output_token_logprobs"] = _lp_entries(req.output_logprobs, req.output_ids, t, tokenizer)
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        start = max(req.logprob_start_len, 0)
        meta["input_token_logprobs"] = _lp_entries(req.input_logprobs, req.input_ids[start:], t, tokenizer) \
            if req.logprob_start_len >= 0 else []
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = _top_entries(req.output_top_logprobs, t, tokenizer)
            meta["input_top_logprobs"] = _top_entries(req.input_top_logprobs, t, tokenizer)
        if req.token_ids_logprob is not None:  # SGLang's keys, entries as the top logprobs'
            meta["output_token_ids_logprobs"] = _top_entries(req.output_token_ids_logprobs, t, tokenizer)
            meta["input_token_ids_logprobs"] = _top_entries(req.input_token_ids_logprobs, t, tokenizer)
    if req.return_routed_experts and req.routes:
        import torch

        meta["routed_experts"] = encode_routes(torch.cat(req.routes)[opts.routed_experts_start_len:])
    return meta


def response_body(req: GenRequest, opts: Options, current_version: str, latency: float, tokenizer: Any) -> dict:
    return {"text": output_text(req, opts, tokenizer), "output_ids": list(req.output_ids),
            "meta_info": meta_info(req, opts, current_version, latency, tokenizer)}
