"""SGLang's wire format for the embedded server: request parsing and validation, response bodies. No I/O.

Schema problems (a missing field, a wrong type) raise `BadRequest`, answered with SGLang's OpenAI-style
400 body. Weight requests that are well-formed but cannot be served raise `Refused`, answered with
`{"success": false, "message": ...}` and 400, as SGLang answers a failed weight operation.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

DEFAULT_GROUP = "weight_update_group"
FLATTENED_BUCKET = "flattened_bucket"
PLAIN_LOAD_FORMATS = (None, "auto")  # one broadcast per tensor, in list order
# dtypes a weight broadcast may carry: SGLang resolves the string with getattr(torch, dtype)
WIRE_DTYPES = {n: getattr(torch, n) for n in (
    "float32", "float", "float64", "double", "float16", "half", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "int8", "int16", "int32", "int64", "long", "uint8", "bool") if isinstance(getattr(torch, n, None), torch.dtype)}
MAX_DIMS = 8


class BadRequest(Exception):
    """Invalid request: SGLang answers these with its OpenAI-style error body."""


class Refused(ValueError):
    """A weight request the server will not run (answered 400 with success=false)."""


class ContractError(BadRequest):
    """A /generate body that breaks SGLang's JSON contract (unknown sampling key, wrong type): `{"error": msg}`."""


class ValueRejected(BadRequest):
    """A well-typed value SGLang refuses (out of range, unsupported): `{"error": {"message": msg}}`."""


class BodyUnparsable(BadRequest):
    """JSON that Python's parser gives up on (nesting past its depth, an integer over 4300 digits): FastAPI's
    HTTPException(400, "There was an error parsing the body") in SGLang, answered with its ErrorResponse."""


class QueueFull(Exception):
    """SGLang's --max-queued-requests refusal: HTTPException(503, "The request queue is full.")."""


QUEUE_FULL = "The request queue is full."


def http_error_body(msg: str, status: int) -> dict:
    """SGLang's handler of a FastAPI HTTPException: ErrorResponse with the status as its type."""
    return {"object": "error", "message": msg, "type": str(status), "param": None, "code": status}


def error_body(e: BadRequest) -> dict:
    """SGLang's 400 body for each kind of bad request."""
    if isinstance(e, BodyUnparsable):
        return http_error_body(str(e), 400)
    if isinstance(e, ContractError):
        return {"error": str(e)}
    if isinstance(e, ValueRejected):
        return handler_error_body(str(e))
    return validation_error_body(str(e))


def validation_error_body(msg: str) -> dict:
    return {"object": "error", "message": msg, "type": "Bad Request", "param": None, "code": 400}


def handler_error_body(msg: str) -> dict:
    return {"error": {"message": msg}}


def result_body(success: bool, message: str, **extra: Any) -> dict:
    return {"success": success, "message": message, **extra}


def clean(x: Any) -> Any:
    """NaN/inf -> null, as SGLang's ORJSON serialisation does."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, list):
        return [clean(v) for v in x]
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    return x


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---- SGLang's request models ---------------------------------------------------------------------
# SGLang's control endpoints take msgspec structs (managers/io_struct.py) that FastAPI validates with pydantic
# in lax mode: "29500" is an int, "true" / 1 a bool, an int is no str, null only where the field is Optional,
# unknown keys are ignored. `validate_model` applies those rules to a body, field by field.
REQUIRED = object()
_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
_INT_LEAD = re.compile(r"-?([1-9][0-9]*)")  # the JSON number pydantic (jiter) tries first
MAX_INT_CHARS = 4300  # pydantic's and CPython's bound on an integer's digits (the sign not counted: pydantic 2.14)
_TRUE = ("1", "on", "t", "true", "y", "yes")
_FALSE = ("0", "off", "f", "false", "n", "no")


class FieldError(ValueError):
    pass


def lax_int(v: Any) -> int:
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise FieldError("Input should be a finite number")
        if not v.is_integer():
            raise FieldError("Input should be a valid integer, got a number with a fractional part")
        if not -2.0 ** 63 < v < 2.0 ** 63:
            raise FieldError("Unable to parse input string as an integer, exceeded maximum size")
        return int(v)
    if isinstance(v, str):
        lead = _INT_LEAD.match(v)  # pydantic reads a number from the raw text first: over 4300 digits is too big
        if lead and len(lead.group(1)) > MAX_INT_CHARS:
            raise FieldError("Unable to parse input string as an integer, exceeded maximum size")
        t = v.strip()
        if not _INT_TEXT.fullmatch(t):
            raise FieldError("Input should be a valid integer, unable to parse string as an integer")
        digits = t.split(".")[0].replace("_", "").lstrip("+")
        sign, digits = ("-", digits[1:]) if digits.startswith("-") else ("", digits)
        digits = digits.lstrip("0") or "0"
        if len(digits) > MAX_INT_CHARS:  # pydantic: too big after cleaning is a plain parse error
            raise FieldError("Input should be a valid integer, unable to parse string as an integer")
        return int(sign + digits)
    raise FieldError("Input should be a valid integer")


def lax_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in _TRUE + _FALSE:
        return v.lower() in _TRUE
    whole = (isinstance(v, int) and -2 ** 63 <= v < 2 ** 63) or (isinstance(v, float) and v.is_integer()
                                                                 and -2.0 ** 63 < v < 2.0 ** 63)
    if isinstance(v, str) or whole:  # pydantic's wording for a string or an i64 it cannot read as a boolean
        raise FieldError("Input should be a valid boolean, unable to interpret input")
    raise FieldError("Input should be a valid boolean")


_FLOAT_TEXT = re.compile(r"[+-]?(?:(?:[0-9]+(?:_[0-9]+)*)(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?:inf|infinity|nan)",
                         re.IGNORECASE)


def lax_float(v: Any) -> float:
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and _FLOAT_TEXT.fullmatch(v.strip()):
        return float(v.strip())
    if isinstance(v, str):
        raise FieldError("Input should be a valid number, unable to parse string as a number")
    raise FieldError("Input should be a valid number")


def lax_str(v: Any) -> str:
    if not isinstance(v, str):
        raise FieldError("Input should be a valid string")
    return v


def lax_dict(v: Any) -> dict:
    if not isinstance(v, dict):
        raise FieldError("Input should be a valid dictionary")
    return v


def optional(kind: Any) -> Any:
    def check(v: Any) -> Any:
        return None if v is None else kind(v)
    return check


def list_of(kind: Any) -> Any:
    def check(v: Any) -> list:
        if not isinstance(v, (list, tuple)):
            raise FieldError("Input should be a valid list")
        out = []
        for i, x in enumerate(v):
            try:
                out.append(kind(x))
            except FieldError as e:
                raise FieldError(f"[{i}]: {e}") from None
        return out
    return check


def literal(*values: str) -> Any:
    said = ", ".join(repr(x) for x in values[:-1]) + f" or {values[-1]!r}"

    def check(v: Any) -> str:
        if not isinstance(v, str) or v not in values:
            raise FieldError(f"Input should be {said}")
        return v
    return check


def shown(v: Any) -> str:
    """A client's value in an error line, cut as pydantic cuts input_value (a 4 MB string is not echoed)."""
    r = repr(v)
    return r if len(r) <= 50 else f"{r[:24]}...{r[-24:]}"


def validate_model(body: dict, fields: dict[str, tuple[Any, Any]], fill_defaults: bool = True) -> dict:
    """The body with each model field coerced as SGLang's pydantic validation does and its default filled in
    (unless not `fill_defaults`); keys outside the model are kept as sent (SGLang ignores them; some are this
    server's extensions)."""
    out = dict(body)
    for key, (kind, default) in fields.items():
        if key not in body:
            if default is REQUIRED:
                raise BadRequest(f"{key}: Field required")
            if fill_defaults:
                out[key] = default
            continue
        try:
            out[key] = kind(body[key])
        except FieldError as e:
            raise BadRequest(f"{key}: {e} (got {shown(body[key])})") from None
    return out


_BASE = {"rid": (optional(lax_str), None), "http_worker_ipc": (optional(lax_str), None)}  # BaseReq
SELECTOR = literal("target", "draft", "all")
# SGLang 0.5.23's io_struct models of the endpoints this server answers, field for field
REQUEST_MODELS: dict[str, dict[str, tuple[Any, Any]]] = {
    "/update_weights_from_disk": {
        **_BASE, "model_path": (lax_str, REQUIRED), "load_format": (optional(lax_str), None),
        "abort_all_requests": (lax_bool, False), "weight_version": (optional(lax_str), None),
        "is_async": (lax_bool, False), "torch_empty_cache": (lax_bool, False), "keep_pause": (lax_bool, False),
        "recapture_cuda_graph": (lax_bool, False), "token_step": (lax_int, 0), "flush_cache": (lax_bool, True),
        "manifest": (optional(lax_dict), None)},
    "/init_weights_update_group": {
        **_BASE, "master_address": (lax_str, REQUIRED), "master_port": (lax_int, REQUIRED),
        "rank_offset": (lax_int, REQUIRED), "world_size": (lax_int, REQUIRED),
        "group_name": (lax_str, DEFAULT_GROUP), "backend": (lax_str, None)},  # absent: nccl, or gloo without CUDA
    "/update_weights_from_distributed": {
        **_BASE, "names": (list_of(lax_str), REQUIRED), "dtypes": (list_of(lax_str), REQUIRED),
        "shapes": (list_of(list_of(lax_int)), REQUIRED), "group_name": (lax_str, DEFAULT_GROUP),
        "flush_cache": (lax_bool, True), "abort_all_requests": (lax_bool, False),
        "weight_version": (optional(lax_str), None), "load_format": (optional(lax_str), None),
        "selector": (SELECTOR, "all"), "torch_empty_cache": (lax_bool, False)},
    "/destroy_weights_update_group": {**_BASE, "group_name": (lax_str, DEFAULT_GROUP)},
    "/update_weight_version": {**_BASE, "new_version": (lax_str, REQUIRED), "abort_all_requests": (lax_bool, True)},
    "/update_weights_from_tensor": {
        **_BASE, "serialized_named_tensors": (list_of(lax_str), REQUIRED), "load_format": (optional(lax_str), None),
        "flush_cache": (lax_bool, True), "abort_all_requests": (lax_bool, False),
        "weight_version": (optional(lax_str), None), "selector": (SELECTOR, "all"),
        "torch_empty_cache": (lax_bool, False)},
    "/pause_generation": {**_BASE, "mode": (literal("abort", "retract", "in_place"), "abort")},
    "/continue_generation": {**_BASE, "torch_empty_cache": (lax_bool, True)},
    "/abort_request": {**_BASE, "abort_all": (lax_bool, False), "finished_reason": (optional(lax_dict), None),
                       "abort_message": (optional(lax_str), None)},
    "/release_memory_occupation": {**_BASE, "tags": (optional(list_of(lax_str)), None)},
    "/resume_memory_occupation": {**_BASE, "tags": (optional(list_of(lax_str)), None)},
    "/post_process_weights": {**_BASE, "restore_weights_before_load": (lax_bool, False),
                              "post_process_quantization": (lax_bool, False)},
    "/begin_weight_update": {**_BASE, "selector": (SELECTOR, "all")},
    "/end_weight_update": dict(_BASE),
    "/weights_checker": {**_BASE, "action": (lax_str, "checksum"), "allow_quant_error": (lax_bool, False),
                         "skip_tensor_list": (optional(list_of(lax_str)), None), "selector": (SELECTOR, "all")},
    "/rollback_weights": dict(_BASE),  # this server's addition
}


# The scalar fields of SGLang's OpenAI CompletionRequest / ChatCompletionRequest (entrypoints/openai/protocol.py)
# that this server reads; coerced where sent (their defaults are the server's own)
_OPENAI_COMMON = {
    "n": (lax_int, 1), "frequency_penalty": (lax_float, 0.0), "presence_penalty": (lax_float, 0.0),
    "seed": (optional(lax_int), None), "stream": (lax_bool, False), "min_tokens": (lax_int, 0),
    "stop_token_ids": (optional(list_of(lax_int)), None), "no_stop_trim": (lax_bool, False),
    "ignore_eos": (lax_bool, False), "skip_special_tokens": (lax_bool, True), "return_token_ids": (lax_bool, False),
    "return_routed_experts": (lax_bool, False), "custom_params": (optional(lax_dict), None)}
OPENAI_MODELS: dict[str, dict[str, tuple[Any, Any]]] = {
    "/v1/completions": {
        **_OPENAI_COMMON, "max_tokens": (lax_int, 16), "temperature": (lax_float, 1.0), "top_p": (lax_float, 1.0),
        "top_k": (lax_int, -1), "min_p": (lax_float, 0.0), "repetition_penalty": (lax_float, 1.0),
        "logprobs": (optional(lax_int), None), "best_of": (optional(lax_int), None), "echo": (lax_bool, False)},
    "/v1/chat/completions": {
        **_OPENAI_COMMON, "max_tokens": (optional(lax_int), None), "max_completion_tokens": (optional(lax_int), None),
        "temperature": (optional(lax_float), None), "top_p": (optional(lax_float), None),
        "top_k": (optional(lax_int), None), "min_p": (optional(lax_float), None),
        "repetition_penalty": (optional(lax_float), None), "logprobs": (lax_bool, False),
        "top_logprobs": (optional(lax_int), None), "return_prompt_token_ids": (lax_bool, False),
        "return_meta_info": (lax_bool, False)},
}


def validate_openai(path: str, body: dict) -> dict:
    """An OpenAI request's scalar fields coerced as SGLang's pydantic models coerce them (as sent, no defaults)."""
    return validate_model(body, OPENAI_MODELS[path], fill_defaults=False)


def validate_request(path: str, body: Any) -> Any:
    """A control endpoint's JSON object checked against its SGLang model (other bodies pass unchanged)."""
    fields = REQUEST_MODELS.get(path)
    if fields is None or not isinstance(body, dict):
        return body
    return validate_model(body, fields)


# ---- weight-update group -----------------------------------------------------------------------
@dataclass(frozen=True)
class GroupInit:
    master_address: str
    master_port: int
    rank: int  # rank_offset + tp_rank; the embedded server is one "GPU", tp_rank 0
    world_size: int
    group_name: str
    backend: str
    timeout_s: float


def _required(body: dict, key: str, check: Any, what: str) -> Any:
    if key not in body:
        raise BadRequest(f"field required: {key}")
    v = body[key]
    if not check(v):
        raise BadRequest(f"{key} must be {what}, got {v!r}")
    return v


def parse_group_name(body: dict) -> str:
    name = body.get("group_name", DEFAULT_GROUP)
    if not isinstance(name, str) or not name:
        raise BadRequest(f"group_name must be a non-empty string, got {name!r}")
    return name


def parse_init_group(body: dict, *, cuda: bool, default_timeout_s: float) -> GroupInit:
    """An /init_weights_update_group body. Backend default: nccl with CUDA (SGLang's default), else gloo."""
    addr = _required(body, "master_address", lambda v: isinstance(v, str) and v, "a non-empty string")
    port = _required(body, "master_port", lambda v: _is_int(v) and 0 < v < 65536, "a TCP port number")
    rank = _required(body, "rank_offset", _is_int, "an integer")
    world = _required(body, "world_size", _is_int, "an integer")
    name = parse_group_name(body)
    backend = body.get("backend") or ("nccl" if cuda else "gloo")
    timeout = body.get("timeout", None)
    timeout = default_timeout_s if timeout is None else timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e7:
        raise BadRequest(f"timeout must be a positive number of seconds, got {timeout!r}")
    if backend not in ("gloo", "nccl"):
        raise Refused(f"backend {backend!r} is not supported: use gloo (CPU) or nccl (CUDA)")
    if backend == "nccl" and not cuda:
        raise Refused("backend 'nccl' needs CUDA, and this server runs without it: ask for backend 'gloo'")
    if world < 2:
        raise Refused(f"world_size must be at least 2 (trainer rank 0 plus this server), got {world}")
    if not 1 <= rank < world:
        raise Refused(f"rank_offset {rank} must be in [1, world_size={world}): rank 0 is the trainer")
    return GroupInit(addr, port, rank, world, name, backend, float(timeout))


# ---- /update_weights_from_distributed ----------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class DistributedUpdate:
    specs: list[TensorSpec]
    group_name: str
    flattened: bool  # load_format flattened_bucket: one uint8 broadcast for the whole bucket
    weight_version: Optional[str]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def parse_dtype(x: Any) -> torch.dtype:
    """'bfloat16' (what trainers send: str(dtype) without 'torch.') or 'torch.bfloat16'."""
    name = x[len("torch."):] if isinstance(x, str) and x.startswith("torch.") else x
    if not isinstance(name, str) or name not in WIRE_DTYPES:
        raise Refused(f"unsupported dtype {x!r}; use one of {sorted(WIRE_DTYPES)}")
    return WIRE_DTYPES[name]


def _shape(x: Any, name: str) -> tuple[int, ...]:
    if not isinstance(x, list) or len(x) > MAX_DIMS or not all(_is_int(d) for d in x):
        raise Refused(f"shape of {name!r} must be a list of at most {MAX_DIMS} integers, got {x!r}")
    if any(d < 0 for d in x):
        raise Refused(f"shape of {name!r} has a negative size: {x}")
    return tuple(x)


def parse_update_distributed(body: dict, max_bytes: int) -> DistributedUpdate:
    """Validate a bucket's layout completely, so that no collective is joined for a malformed request."""
    names = _required(body, "names", lambda v: isinstance(v, list), "a list")
    dtypes = _required(body, "dtypes", lambda v: isinstance(v, list), "a list")
    shapes = _required(body, "shapes", lambda v: isinstance(v, list), "a list")
    group = parse_group_name(body)
    fmt = body.get("load_format")
    if fmt not in PLAIN_LOAD_FORMATS and fmt != FLATTENED_BUCKET:
        raise Refused(f"load_format {fmt!r} is not supported: omit it (one broadcast per tensor) or use "
                      f"{FLATTENED_BUCKET!r} (one uint8 broadcast per bucket)")
    if not len(names) == len(dtypes) == len(shapes):
        raise Refused(f"names, dtypes and shapes must have the same length, got {len(names)}, {len(dtypes)} "
                      f"and {len(shapes)}")
    if not all(isinstance(n, str) and n for n in names):
        raise Refused("names must be non-empty strings")
    if fmt == FLATTENED_BUCKET and not names:
        raise Refused("a flattened_bucket update needs at least one tensor (SGLang: cannot create empty tensor bucket)")
    specs = [TensorSpec(n, parse_dtype(d), _shape(s, n)) for n, d, s in zip(names, dtypes, shapes)]
    version = body.get("weight_version")
    upd = DistributedUpdate(specs, group, fmt == FLATTENED_BUCKET, None if version is None else str(version))
    if upd.nbytes > max_bytes:
        raise Refused(f"bucket of {upd.nbytes} bytes exceeds this server's limit of {max_bytes} bytes "
                      "(8 bytes per model parameter)")
    return upd


def byte_ranges(specs: list[TensorSpec]) -> list[tuple[int, int]]:
    """[start, end) of each tensor in a flattened bucket: the bytes of each tensor in order, no padding."""
    out, pos = [], 0
    for s in specs:
        out.append((pos, pos + s.nbytes))
        pos += s.nbytes
    return out


def unflatten(flat: torch.Tensor, specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """SGLang's FlattenedTensorBucket.reconstruct_tensors: flat[start:end].view(dtype).reshape(shape).

    A slice whose offset is not a multiple of its dtype's size is copied first (SGLang's view would fail).
    """
    out = []
    for s, (a, b) in zip(specs, byte_ranges(specs)):
        part = flat[a:b]
        if a % s.dtype.itemsize:
            part = part.clone()
        out.append((s.name, part.view(s.dtype).reshape(s.shape)))
    return out
