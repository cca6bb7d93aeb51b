"""Information endpoints of the embedded server: /health, /model_info, /server_info, /v1/loads.

/server_info carries the server-argument fields RL frameworks read from SGLang's (slime's external-engine
check reads `enable_memory_saver`, AReaL and verl read the parallel sizes and limits).
"""
from __future__ import annotations

import datetime
import time
from typing import Any, Optional

from aiohttp import web

from mega_async.server.memory import resident_weight_bytes
from mega_async.server.weights import mtp_layers_held

EmbeddedServer = Any  # app.py's EmbeddedServer (app.py imports this module)


class InfoEndpoints:
    def __init__(self, server: "EmbeddedServer") -> None:
        self.s = server

    def register(self, r: web.UrlDispatcher) -> None:
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_get("/v1/loads", self.loads)
        if not self.s.release.sessions:  # 0.5.18-0.5.20 answer 404 "deprecated"; 0.5.21 removed the route
            for path in ("/get_weight_version", "/weight_version"):
                r.add_get(path, self.weight_version)

    def model_path(self) -> str:
        return self.s.updates.loaded_path or self.s.model_path

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.s.engine.model.config
        return web.json_response({
            "model_path": self.model_path(), "tokenizer_path": self.s.model_path, "is_generation": True,
            "served_model_name": self.s.served_model_name, "preferred_sampling_params": None,
            "weight_version": self.s.engine.weight_version, "load_format": "auto",
            # SGLang 0.5.23's other fields, as its CPU engine answers them for this kind of server (its `embedding`
            # block, for embedding models, is left out: this server serves none)
            "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None),
        })

    def server_args(self) -> dict[str, Any]:
        s, eng = self.s, self.s.engine
        return {
            "model_path": self.model_path(), "tokenizer_path": s.model_path, "served_model_name": s.served_model_name,
            "host": s.host, "port": s.port, "tp_size": 1, "dp_size": 1, "ep_size": 1, "pp_size": 1,
            "nnodes": 1, "node_rank": 0, "dtype": s.dtype, "device": s.device, "load_format": "auto",
            "context_length": s.max_context, "max_running_requests": eng.max_batch_size,
            "max_total_num_tokens": s.max_context * eng.max_batch_size, "page_size": 1,
            "random_seed": None, "skip_tokenizer_init": s.tokenizer is None, "skip_server_warmup": True,
            "disable_radix_cache": not eng.prefix_cache.enabled, "chunked_prefill_size": -1,
            "enable_memory_saver": s.enable_memory_saver, "enable_weights_cpu_backup": True, "enable_draft_weights_cpu_backup": False,
            "enable_return_routed_experts": s.enable_return_routed_experts, "enable_return_hidden_states": False,
            "speculative_algorithm": None, "enable_dp_attention": False, "enable_eplb": False,
            "moe_a2a_backend": "none", "api_key": None, "weights_root": str(s.weights_root),
            "enable_custom_logit_processor": s.enable_custom_logit_processor, "allow_auto_truncate": False,
        }

    async def server_info(self, request: web.Request) -> web.Response:
        eng = self.s.engine
        return web.json_response({
            **self.server_args(), "version": self.s.release.version,
            "embedded_server": "mega_async", "weight_version": eng.weight_version,
            "mtp_layers_kept": mtp_layers_held(eng.model),
            # each joined weight-update group: how many broadcasts it completed (mega_async's: a trainer names a
            # member that acknowledged a bucket without receiving it, whatever the weights; SGLang has no such field)
            "weight_update_groups": {name: {"broadcasts_received": g.received}
                                     for name, g in list(self.s.updates.groups.items())},
            "num_running_reqs": eng.num_running, "num_waiting_reqs": eng.num_waiting, "paused": eng.paused,
            "memory_released": sorted(eng.released), "resident_weight_bytes": resident_weight_bytes(eng.model),
            "prefix_cache": {"entries": len(eng.prefix_cache), "tokens": eng.prefix_cache.num_tokens,
                             "hits": eng.prefix_cache.hits, "hit_tokens": eng.prefix_cache.hit_tokens},
            "internal_states": [{"last_gen_throughput": None, "avg_spec_accept_length": None,
                                 "generated_tokens": eng.generated_tokens, "decode_steps": eng.steps}],
        })

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.s._ready else 503)

    async def weight_version(self, request: web.Request) -> web.Response:
        """As SGLang 0.5.18-0.5.20: the weight version is at /model_info."""
        msg = "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' instead."
        return web.json_response({"object": "error", "message": msg, "type": "404", "param": None, "code": 404},
                                 status=404)

    # ---- /v1/loads ------------------------------------------------------------------------------
    def load_snapshot(self) -> dict[str, Any]:
        """SGLang's LoadSnapshot core keys for this server's one DP rank, plus its queues section (the memory,
        speculative, lora and disaggregation sections are absent: SGLang leaves out a section it has no data
        for)."""
        s, eng = self.s, self.s.engine
        now, made = time.monotonic(), eng.generated_tokens
        last_t, last_made = self._last_sample or (now, made)
        self._last_sample = (now, made)
        running = [len(r.seq) for r in list(eng._running)]
        with eng._lock:
            waiting = [len(r.seq) for r in eng._waiting]
        total = s.max_context * eng.max_batch_size
        used = sum(running) + eng.prefix_cache.num_tokens
        tree = eng.prefix_cache
        return {
            "timestamp": time.time(), "dp_rank": 0, "num_running_reqs": len(running),
            "num_waiting_reqs": len(waiting), "num_waiting_uncached_tokens": sum(waiting),
            "num_used_tokens": used, "num_total_tokens": total, "num_active_tokens": sum(running),
            "num_prealloc_ready_tokens": 0, "max_total_num_tokens": total, "max_running_requests": eng.max_batch_size,
            "token_usage": round(used / total, 4) if total else 0.0,
            "gen_throughput": round((made - last_made) / (now - last_t), 2) if now > last_t else 0.0,
            "cache_hit_rate": round(tree.hit_tokens / tree.query_tokens, 4) if tree.query_tokens else 0.0,
            "utilization": round(max(used / total if total else 0.0, len(running) / max(eng.max_batch_size, 1)), 4),
            "total_prefill_uncached_tokens": tree.query_tokens - tree.hit_tokens, "total_prefill_busy_us": 0,
            "decode_moments": None,
            "queues": {"waiting": len(waiting), "grammar": 0, "paused": len(waiting) if eng.paused else 0,
                       "retracted": 0, "prealloc_ready": 0},
        }

    _last_sample: Optional[tuple[float, int]] = None

    async def loads(self, request: web.Request) -> web.Response:
        """GET /v1/loads?dp_rank=&include=&format=json|prometheus, as SGLang 0.5.23's endpoint."""
        q = request.query
        try:
            dp_rank = None if q.get("dp_rank") in (None, "") else int(q["dp_rank"])
        except ValueError:
            return web.json_response({"object": "error", "message": f"dp_rank: Input should be a valid integer, "
                                      f"unable to parse string as an integer (got {q['dp_rank']!r})",
                                      "type": "Bad Request", "param": None, "code": 400}, status=400)
        include = {x.strip() for x in q["include"].split(",")} if q.get("include") else None
        if include is not None and not include <= LOAD_SECTIONS:
            return web.json_response({"object": "error", "message": f"Invalid include sections: "
                                      f"{include - LOAD_SECTIONS}. Valid options: {sorted(LOAD_SECTIONS)}",
                                      "type": "400", "param": None, "code": 400}, status=400)
        loads = [] if dp_rank not in (None, 0) else [self.load_snapshot()]
        if include is not None and "all" not in include and "queues" not in include:
            for load in loads:
                load.pop("queues")
        if q.get("format") == "prometheus":
            lines = []
            for load in loads:
                for key, value in load.items():
                    items = value.items() if isinstance(value, dict) else [(None, value)]
                    for sub, v in items:
                        if isinstance(v, (int, float)) and key != "dp_rank" and not isinstance(v, bool):
                            name = f"sglang_{key}_{sub}" if sub else f"sglang_{key}"
                            lines += [f"# TYPE {name} gauge", f'{name}{{dp_rank="0"}} {v}']
            return web.Response(body=("\n".join(lines) + "\n").encode(),
                                headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
        import torch

        return web.json_response({
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": self.s.release.version,
            "accelerator": torch.cuda.get_device_name() if self.s.engine.device.type == "cuda" else None,
            "num_accelerators": 1, "loads": loads})


LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
