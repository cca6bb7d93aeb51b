"""Run under torchrun by test_sglang_interop.py: the project's trainer side (Megatron at a layout, gloo) drives
distributed_sync through SGLangClient into receivers built from SGLang releases (sglang_receiver.py).

For each receiver and each load format: a "training step" changes every weight (the same seed on every rank,
so replicated tensors stay equal), push() sends them, and rank 0 writes the trainer's own HF export
(expected_<tag>.safetensors) and asks the receiver to dump what its model holds (received_<tag>.safetensors).
After a push, verify() checks the servers' /weights_checker checksums (verify_method="checksum"). A failed push
or verify is recorded (error, verify), not raised, so the test can show SGLang's answer. Rank 0 writes
result.json.
"""
import argparse
import asyncio
import json
import os

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from mega_async.inference.client import SGLangClient
from mega_async.trainer.model import build_model
from mega_async.trainer.parallel import destroy_parallel_state
from mega_async.trainer.sync import distributed_sync, RolloutSide, SyncError
from mega_async.trainer.weights import export_hf_weights
from mega_async.api.types import WeightVersion


async def _call(client: SGLangClient, method: str, path: str, body=None) -> tuple:
    return await client._request(method, client.servers[0], path, body, timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--server", action="append", required=True, help="TAG=HOST:PORT, one per receiver")
    ap.add_argument("--formats", default="tensor,flattened_bucket")
    ap.add_argument("--bucket-bytes", type=int, default=64 << 10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    models = build_model(args.model, args.layout, load_weights=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    os.makedirs(args.out, exist_ok=True)
    result: dict = {"layout": args.layout, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                    "cases": {}}
    step = 0
    try:
        for spec in args.server:
            tag, address = spec.split("=", 1)
            version = WeightVersion()
            client = SGLangClient([address], version=version, request_timeout=120) if rank == 0 else None
            for fmt in args.formats.split(","):
                step += 1
                with torch.no_grad():  # a training step: every weight moves
                    gen = torch.Generator().manual_seed(1000 + step)
                    for p in models[0].parameters():
                        p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
                case: dict = {"format": fmt, "server": address}
                sync = distributed_sync(models, version, RolloutSide(client), [address], load_format=fmt,
                                             bucket_bytes=args.bucket_bytes, timeout=60, verify_method="checksum")
                try:
                    case["stats"] = sync.push()
                    case["error"] = None
                    try:  # trainer.verify_sync on real SGLang: its /weights_checker checksums
                        sync.verify()
                        case["verify"] = None
                    except SyncError as e:
                        case["verify"] = str(e)
                except SyncError as e:
                    case["error"] = str(e)
                finally:
                    sync.close()
                expected = {k: v.contiguous() for k, v in export_hf_weights(models)}  # collective: every rank
                if rank == 0:
                    name = f"{tag}_{fmt}"
                    save_file(expected, os.path.join(args.out, f"expected_{name}.safetensors"))
                    received = os.path.join(args.out, f"received_{name}.safetensors")
                    status, body = asyncio.run(_call(client, "POST", "/interop/dump_weights", {"path": received}))
                    case["dump"] = {"status": status, "body": body}
                    case["model_info"] = asyncio.run(_call(client, "GET", "/model_info"))[1]
                    case["version"] = version.value
                    result["cases"][name] = case
                if dist.is_initialized():
                    dist.barrier()
            if rank == 0:
                result.setdefault("logs", {})[tag] = asyncio.run(_call(client, "GET", "/interop/log"))[1]
    finally:
        if rank == 0:
            with open(os.path.join(args.out, "result.json"), "w") as f:
                json.dump(result, f, indent=1, default=str)
        destroy_parallel_state()


if __name__ == "__main__":
    main()
