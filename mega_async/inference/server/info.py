"""Information endpoints of the embedded server: /health, /model_info, /server_info, /get_weight_version.

/server_info carries the server-argument fields RL frameworks read from SGLang's (slime's external-engine
check reads `enable_memory_saver`, AReaL and verl read the parallel sizes and limits).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from mega_async.inference.server.memory import resident_weight_bytes

if TYPE_CHECKING:
    from mega_async.inference.server.app import EmbeddedServer


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
            "enable_memory_saver": True, "enable_weights_cpu_backup": True, "enable_draft_weights_cpu_backup": False,
            "enable_return_routed_experts": s.enable_return_routed_experts, "enable_return_hidden_states": False,
            "speculative_algorithm": None, "enable_dp_attention": False, "enable_eplb": False,
            "moe_a2a_backend": "none", "api_key": None, "weights_root": str(s.weights_root),
            "enable_custom_logit_processor": False, "allow_auto_truncate": False,
        }

    async def server_info(self, request: web.Request) -> web.Response:
        eng = self.s.engine
        return web.json_response({
            **self.server_args(), "version": self.s.release.version,
            "embedded_server": "mega_async", "weight_version": eng.weight_version,
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
