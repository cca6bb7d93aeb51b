"""The endpoints of a fleet server: SGLang's paths, bodies and messages (as the embedded server mirrors them),
with every weight transfer replaced by a timed no-op. No torch.distributed group is joined: a trainer syncing
a fleet runs its control plane only (distributed_sync(data_plane="none"), which checks /server_info's
`fleet.data_plane` first)."""
from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Callable

from aiohttp import web

from mega_async.inference.sim.fleet.model import BadRequest, SimRequest
from mega_async.api.sglang_releases import BEGIN_TWICE, END_WITHOUT_BEGIN, SELECTORS, session_refusal

SimServer = Any  # the fleet server (server.py) whose endpoints these are: it imports this module

DTYPE_BYTES = {"float32": 4, "float": 4, "float64": 8, "double": 8, "float16": 2, "half": 2, "bfloat16": 2,
               "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8,
               "long": 8, "bool": 1}
PAUSE_MODES = ("abort", "retract", "in_place")
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")

Reply = tuple[Any, int]


def routes(s: "SimServer") -> dict[str, tuple[tuple[str, ...], Callable[[web.BaseRequest], Any]]]:
    post, get, both = ("POST",), ("GET",), ("GET", "POST")
    table: dict[str, tuple[tuple[str, ...], Callable]] = {
        "/generate": (("POST", "PUT"), lambda r: generate(s, r)),
        "/pause_generation": (post, lambda r: pause(s, r)),
        "/continue_generation": (post, lambda r: resume(s, r)),
        "/abort_request": (post, lambda r: abort_request(s, r)),
        "/flush_cache": (both, lambda r: flush_cache(s, r)),
        "/update_weights_from_disk": (post, lambda r: from_disk(s, r)),
        "/init_weights_update_group": (post, lambda r: init_group(s, r)),
        "/update_weights_from_distributed": (post, lambda r: from_distributed(s, r)),
        "/destroy_weights_update_group": (post, lambda r: destroy_group(s, r)),
        "/update_weight_version": (post, lambda r: set_version(s, r)),
        "/weights_checker": (both, lambda r: weights_checker(s, r)),
        "/health": (get, lambda r: health(s, r)),
        "/health_generate": (get, lambda r: health(s, r)),
        "/model_info": (get, lambda r: model_info(s, r)),
        "/get_model_info": (get, lambda r: model_info(s, r)),
        "/server_info": (get, lambda r: server_info(s, r)),
        "/get_server_info": (get, lambda r: server_info(s, r)),
    }
    if s.release.sessions:  # SGLang 0.5.21+
        table["/begin_weight_update"] = (post, lambda r: begin_session(s, r))
        table["/end_weight_update"] = (post, lambda r: end_session(s, r))
    return table


def _bad(msg: str) -> Exception:
    return BadRequest(msg)


def _int(body: dict, key: str, default: Any = None) -> Any:
    v = body.get(key, default)
    if v is None or isinstance(v, bool):
        if v is None and default is None:
            return None
        raise _bad(f"{key} must be an integer, got {v!r}")
    try:
        return int(v)
    except (TypeError, ValueError):
        raise _bad(f"{key} must be an integer, got {v!r}") from None


# ---- generation --------------------------------------------------------------------------------------
async def generate(s: "SimServer", request: web.BaseRequest) -> Reply:
    body = await s.body(request)
    s.counters["received"] += 1  # arrived (a paused server holds it before it counts as a request)
    if body.get("stream"):
        raise _bad("the fleet answers non-streaming /generate only (stream=false)")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise _bad("input_ids must be a non-empty list of token ids (a fleet server has no tokenizer and serves "
                   "one prompt per request)")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise _bad("sampling_params must be an object")
    max_new = _int(sp, "max_new_tokens", 128)
    if max_new < 0:
        raise _bad(f"max_new_tokens must be at least 0, got {max_new}")
    stops = sp.get("stop_token_ids") or []
    stop = None if sp.get("ignore_eos") else (int(stops[0]) if stops else s.tokens.ids[0])
    rid = body.get("rid") or s.new_rid()
    if not isinstance(rid, str):
        raise _bad(f"rid must be a string, got {rid!r}")
    if rid in s.live:
        raise _bad(f"Duplicate request ID detected: {rid}")
    await s.wait_until(s.admitting)  # SGLang holds new requests while paused (and behind a waiting update)
    key = hash(tuple(ids))
    cont = s.continuations.pop(key)
    if cont is not None:  # a resubmission of an aborted request: its plan goes on
        planned, offset, server, epoch = cont
        cached = len(ids) - 1 if (server, epoch) == (s.index, s.cache_epoch) else 0
    else:
        planned, offset, cached = s.tokens.length(key), s.tokens.offset(key), 0
    if stop is None:
        planned = max_new
    loop = asyncio.get_running_loop()
    r = SimRequest(rid, ids, planned, min(planned, max_new), stop, offset, s.version, cached,
                   bool(body.get("return_logprob")), loop.create_future())
    if r.target == 0:
        s.live[rid] = r
        s.finish(r, None)
        return r.fut.result(), 200
    s.submit(r)
    try:
        out = await r.fut
    except asyncio.CancelledError:  # the client went away, or the server crashed
        s.drop(r)
        raise
    return out, 200


async def pause(s: "SimServer", request: web.BaseRequest) -> Reply:
    body = await s.body(request, required=False)
    mode = body.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise _bad(f"mode: Input should be 'abort', 'retract' or 'in_place', got {mode!r}")
    aborted = s.pause(mode)
    await asyncio.sleep(0)  # the aborted requests' answers go out
    if aborted and s.cfg.pause_poll_s:  # SGLang: handlers still held its lock, so it sleeps before looking again
        s.counters["pause_polls"] += 1
        await asyncio.sleep(s.cfg.seconds(s.cfg.pause_poll_s))
    return {"message": "Generation paused successfully.", "status": "ok"}, 200


async def resume(s: "SimServer", request: web.BaseRequest) -> Reply:
    await s.body(request, required=False)
    s.resume()
    return {"message": "Generation continued successfully.", "status": "ok"}, 200


async def abort_request(s: "SimServer", request: web.BaseRequest) -> web.Response:
    body = await s.body(request, required=False)
    rid, abort_all = body.get("rid") or "", bool(body.get("abort_all"))
    if abort_all:
        s.abort_live()
    elif rid:  # neither: SGLang ignores the request
        s.abort_live(rid=rid)
    return web.Response(status=200)


async def flush_cache(s: "SimServer", request: web.BaseRequest) -> web.Response:
    if not s.flush():
        return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.\n")
    return web.Response(status=200, text="Cache flushed.\nPlease check backend logs for more details. (When there "
                                         "are running or waiting requests, the operation will not be performed.)\n")


# ---- weights -----------------------------------------------------------------------------------------
def _version_note(v: Any) -> str:
    return "" if v is None else f" Weight version updated to {v}."


async def from_disk(s: "SimServer", request: web.BaseRequest) -> Reply:
    body = await s.body(request)
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise _bad("model_path: Field required (a non-empty string)")
    v = body.get("weight_version")
    if body.get("abort_all_requests"):
        s.abort_live()

    async def run() -> Reply:
        await asyncio.sleep(s.cfg.seconds(s.cfg.load_s))
        s.weights_id = f"disk:{path}:{v}"
        if v is not None:
            s.set_version(str(v))
        s.counters["disk_updates"] += 1
        if body.get("flush_cache", True) and not s.flush():
            return {"success": False, "message": FLUSH_REFUSED, "num_paused_requests": 0}, 400
        return {"success": True, "message": "Succeeded to update model weights." + _version_note(v),
                "num_paused_requests": 0}, 200

    return await s.exclusive(run)


async def init_group(s: "SimServer", request: web.BaseRequest) -> Reply:
    body = await s.body(request)
    for key in ("master_address", "master_port", "rank_offset", "world_size"):
        if key not in body:
            raise _bad(f"{key}: Field required")
    rank, world = _int(body, "rank_offset"), _int(body, "world_size")
    name = body.get("group_name", "weight_update_group")
    fail = "Failed to initialize custom process group: "
    if not 1 <= rank < world:
        return {"success": False, "message": fail + f"rank_offset {rank} is outside 1..world_size-1 ({world})."}, 400
    if name in s.groups:
        return {"success": False, "message": fail + f"group {name!r} already exists; destroy it first."}, 400
    await asyncio.sleep(s.cfg.seconds(s.cfg.init_group_s))
    s.groups[name] = {"master": f"{body['master_address']}:{body['master_port']}", "rank": rank, "world": world,
                      "backend": body.get("backend", "nccl")}
    return {"success": True, "message": "Succeeded to initialize custom process group."}, 200


def _unaligned(names: list, dtypes: list, shapes: list) -> Any:
    offset = 0
    for n, d, shape in zip(names, dtypes, shapes):
        size = DTYPE_BYTES[d]
        if offset % size:
            return f"Failed to receive weights: Unaligned received tensor {n}: byte offset {offset}, dtype torch.{d}"
        offset += size * _numel(shape)
    return None


def _numel(shape: list) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


async def from_distributed(s: "SimServer", request: web.BaseRequest) -> Reply:
    body = await s.body(request)
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) or \
            not len(names) == len(dtypes) == len(shapes):
        raise _bad("names, dtypes and shapes must be lists of one length")
    bad = [d for d in dtypes if d not in DTYPE_BYTES]
    if bad:
        raise _bad(f"dtypes: unknown dtype {bad[0]!r}")
    if s.release.sessions and s.session is None:
        return {"success": False, "message": session_refusal("update_weights_from_distributed")}, 400
    name = body.get("group_name", "weight_update_group")
    fail = "Failed to update parameter online: "
    if name not in s.groups:
        return {"success": False, "message": fail + f"no weight update group {name!r}: call "
                                                    "/init_weights_update_group first."}, 400
    flat = body.get("load_format") == "flattened_bucket"
    if flat and s.release.refuses_unaligned_buckets:
        why = _unaligned(names, dtypes, shapes) if names else "Failed to receive weights: empty flattened bucket"
        if why:
            return {"success": False, "message": why}, 400
    nbytes = sum(DTYPE_BYTES[d] * _numel(sh) for d, sh in zip(dtypes, shapes))
    v = body.get("weight_version")

    async def run() -> Reply:
        if names:  # the broadcast this bucket would receive, timed (nothing is received)
            await asyncio.sleep(s.cfg.seconds(s.cfg.bucket_s + nbytes / (s.cfg.bandwidth_gbps * 1e9)))
            s.weights_id = hashlib.sha256(f"{s.weights_id}|{names}|{shapes}".encode()).hexdigest()
            s.counters["buckets"] += 1
            s.counters["bucket_bytes"] += nbytes
        if v is not None:
            s.set_version(str(v))
        if body.get("flush_cache", True) and not s.flush():
            return {"success": False, "message": FLUSH_REFUSED}, 400
        return {"success": True, "message": "Succeeded to update parameter online." + _version_note(v)}, 200

    return await s.exclusive(run)


async def destroy_group(s: "SimServer", request: web.BaseRequest) -> Reply:
    body = await s.body(request, required=False)
    if s.groups.pop(body.get("group_name", "weight_update_group"), None) is None:
        return {"success": False, "message": "The group to be destroyed does not exist."}, 400
    return {"success": True, "message": "Succeeded to destroy custom process group."}, 200


async def set_version(s: "SimServer", request: web.BaseRequest) -> Reply:
    body = await s.body(request)
    v = body.get("new_version")
    if not isinstance(v, (str, int)) or isinstance(v, bool) or v == "":
        raise _bad(f"new_version must be a non-empty string, got {v!r}")
    if body.get("abort_all_requests", True):
        s.abort_live()
    s.set_version(str(v))
    return {"success": True, "message": f"Weight version updated to {v}", "new_version": str(v)}, 200


async def begin_session(s: "SimServer", request: web.BaseRequest) -> Reply:
    body = await s.body(request, required=False)
    selector = body.get("selector", "all")
    if selector not in SELECTORS:
        raise _bad(f"selector: Input should be 'target', 'draft' or 'all', got {selector!r}")
    if s.session is not None:
        return {"success": False, "message": BEGIN_TWICE}, 400

    async def run() -> None:
        s.session = selector

    await s.exclusive(run)
    return {"success": True, "message": "Success"}, 200


async def end_session(s: "SimServer", request: web.BaseRequest) -> Reply:
    await s.body(request, required=False)
    if s.session is None:
        return {"success": False, "message": END_WITHOUT_BEGIN}, 400
    s.session = None
    return {"success": True, "message": "Success"}, 200


async def weights_checker(s: "SimServer", request: web.BaseRequest) -> Reply:
    body = await s.body(request, required=False)
    action = body.get("action", "checksum")
    if action not in ("checksum", "snapshot", "compare", "reset_tensors"):
        return {"success": False, "message": f"Unsupported action={action!r}"}, 400
    if action != "checksum":
        return {"success": True, "message": "Success."}, 200
    digest = hashlib.sha256(s.weights_id.encode()).hexdigest()
    info: dict[str, Any] = dict(role="target", tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1,
                                rank=0, size=1)
    if not s.release.sessions:  # 0.5.18-0.5.20: one ParallelismInfo without a role
        info.pop("role")
    rank = {"checksums": {"model": digest}, "per_gpu_checksum": digest,
            "parallelism_info": [info] if s.release.sessions else info}
    return {"success": True, "message": "Success.", "ranks": [rank],
            "per_engine_checksum": hashlib.sha256(digest.encode()).hexdigest()}, 200


# ---- information -------------------------------------------------------------------------------------
async def health(s: "SimServer", request: web.BaseRequest) -> web.Response:
    return web.Response(status=200)


async def model_info(s: "SimServer", request: web.BaseRequest) -> Reply:
    return {"model_path": "mega_async-fleet", "tokenizer_path": None, "is_generation": True,
            "served_model_name": "mega_async-fleet", "preferred_sampling_params": None,
            "weight_version": s.version, "load_format": "auto", "model_type": "fleet",
            "architectures": ["FleetSimulatedForCausalLM"]}, 200


async def server_info(s: "SimServer", request: web.BaseRequest) -> Reply:
    c = s.cfg
    return {"model_path": "mega_async-fleet", "host": s.host, "port": s.port, "tp_size": 1, "dp_size": 1,
            "pp_size": 1, "ep_size": 1, "nnodes": 1, "node_rank": 0, "max_running_requests": c.max_running_requests,
            "context_length": 1 << 20, "page_size": 1, "skip_tokenizer_init": True, "load_format": "auto",
            "version": c.sglang_version, "weight_version": s.version, "num_running_reqs": len(s.running),
            "num_waiting_reqs": len(s.waiting), "paused": s.paused is not None,
            "internal_states": [{"last_gen_throughput": None, "generated_tokens": s.counters["tokens"]}],
            "fleet": {"index": s.index, "data_plane": c.data_plane, "restarts": s.restarts,
                      "session": s.session, "groups": sorted(s.groups)}}, 200
