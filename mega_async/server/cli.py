"""Command line of the embedded server: `python -m mega_async.server --model DIR --port N`."""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Optional

import torch
from mega_async.server.app import DTYPES, EmbeddedServer
from mega_async.server.connections import ConnectionLimits, serve
from mega_async.api.config import MAX_SEED
from mega_async.api.sglang_releases import MIRRORED_DEFAULT, TESTED_RANGE, untested_reason
from mega_async.bridge.model_cards import ModelTooLarge

logger = logging.getLogger("mega_async.server")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="mega_async embedded inference server (SGLang protocol)")
    p.add_argument("--model", "--model-path", dest="model", required=True, help="HF-format model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--weights-root", default=None, help="weight updates load only from directories under this root "
                   "(default: the model directory's parent)")
    p.add_argument("--api-key", default=os.environ.get("MEGA_ASYNC_API_KEY"))
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="SGLang's flag: requests waiting beyond the running ones are refused past this many (503 "
                        "'The request queue is full.'); default none, as SGLang")
    p.add_argument("--max-requests-per-body", type=int, default=1 << 14,
                   help="most generations (prompts x sampling_params.n) one /generate or OpenAI body may ask; more "
                        "is refused with 400 (SGLang has no such bound)")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice); give each of N servers on one host cores/N")
    p.add_argument("--weight-update-timeout", type=float, default=300.0,
                   help="seconds a weight-update group waits for its peers (rendezvous and each broadcast) when "
                        "/init_weights_update_group gives no timeout")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="record each MoE router's top-k per token so /generate may ask return_routed_experts")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="no radix cache (every prompt is prefilled, cached_tokens is always 0)")
    p.add_argument("--prefix-cache-tokens", type=int, default=1 << 16,
                   help="token budget of the radix cache (LRU leaves evicted beyond it; SGLang has none of its "
                        "own: its tree lives in the KV pool, --max-total-tokens)")
    p.add_argument("--served-model-name", default=None, help="model id of /v1/models (default: the model path)")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="report enable_memory_saver as SGLang does when started with it (colocated runs); "
                        "/release_memory_occupation frees memory either way")
    p.add_argument("--enable-custom-logit-processor", action="store_true",
                   help="SGLang's flag, reported in /server_info; the embedded server still runs no custom logit "
                        "processor (they are pickled code) and says so instead of SGLang's 'not enabled'")
    p.add_argument("--sglang-version", default=MIRRORED_DEFAULT,
                   help=f"the SGLang release whose weight-update protocol to mirror ({TESTED_RANGE}; before 0.5.21: "
                        "no /begin_weight_update sessions)")
    p.add_argument("--header-timeout", type=float, default=ConnectionLimits.header_timeout,
                   help="seconds a client has to send a request's line and headers (from connecting, or from the "
                        "request's first byte on a kept-alive connection); slower connections are closed")
    p.add_argument("--body-timeout", type=float, default=ConnectionLimits.body_timeout,
                   help="seconds a client has to send a request's body; past it 408 and the connection is closed")
    p.add_argument("--max-connections", type=int, default=0,
                   help="client connections open at once (default: the open-file limit, raised to its hard limit, "
                        "less a reserve); past it a new connection closes the one waiting longest for its request")
    p.add_argument("--max-body-bytes", type=int, default=ConnectionLimits.max_body_bytes,
                   help="bytes of request bodies held at once over all connections (default 1 GiB); a request that "
                        "would pass it is answered 503 with Retry-After, its body unread")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (Path(args.model) / "config.json").exists():
        raise SystemExit(f"--model {args.model}: no config.json there; pass an HF-format model directory")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise SystemExit(f"--max-queued-requests {args.max_queued_requests}: must be at least 0 (leave it out for "
                         "no bound)")
    if args.max_requests_per_body < 1:
        raise SystemExit(f"--max-requests-per-body {args.max_requests_per_body}: must be at least 1")
    if args.prefix_cache_tokens < 0:
        raise SystemExit(f"--prefix-cache-tokens {args.prefix_cache_tokens}: must be at least 0 (0 disables it)")
    if untested_reason(args.sglang_version):
        raise SystemExit(f"--sglang-version {args.sglang_version}: {untested_reason(args.sglang_version)}; "
                         f"give one of {TESTED_RANGE}")
    limits = ConnectionLimits(args.header_timeout, args.body_timeout, args.max_connections,
                              max_body_bytes=args.max_body_bytes)
    try:
        limits.validate()
    except ValueError as e:
        raise SystemExit(f"--{str(e).replace('_', '-')}") from None
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if not 0 <= args.random_seed <= MAX_SEED:
        raise SystemExit(f"--random-seed {args.random_seed}: must be in [0, {MAX_SEED}]")
    try:
        server = _server(args, limits)
    except (ModelTooLarge, FileNotFoundError, ValueError, KeyError) as e:  # bad input: one line, no traceback
        raise SystemExit(str(e) if isinstance(e, ModelTooLarge) else f"--model {args.model}: {type(e).__name__}: "
                         f"{e}") from None
    logger.info("serving %s on http://%s:%d", args.model, args.host, args.port)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its requests
    serve(server.app(), args.host, args.port, limits, shutdown_timeout=5.0)


def _server(args: argparse.Namespace, limits: ConnectionLimits) -> EmbeddedServer:
    return EmbeddedServer(args.model, dtype=args.dtype, device=args.device, weights_root=args.weights_root,
                            api_key=args.api_key, max_batch_size=args.max_running_requests, seed=args.random_seed,
                            host=args.host, port=args.port, weight_update_timeout_s=args.weight_update_timeout,
                            prefix_cache_tokens=0 if args.disable_radix_cache else args.prefix_cache_tokens,
                            enable_return_routed_experts=args.enable_return_routed_experts,
                            served_model_name=args.served_model_name, sglang_version=args.sglang_version,
                            enable_memory_saver=args.enable_memory_saver,
                            enable_custom_logit_processor=args.enable_custom_logit_processor,
                            max_queued_requests=args.max_queued_requests,
                            max_requests_per_body=args.max_requests_per_body, connection_limits=limits)
