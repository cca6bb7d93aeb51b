"""Run under torchrun by tests/dist/test_resharder.py: build the model at a layout with HF weights loaded,
stream the resharder's buckets, and let each stage head write what it received (tensors and bucket list)."""
import argparse
import json
import os

import torch.distributed as dist
from megatron.core import parallel_state as mpu
from safetensors.torch import save_file

from mega_async.trainer.model import build_model
from mega_async.trainer.parallel import destroy_parallel_state
from mega_async.trainer.weights import Resharder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bucket-bytes", type=int, required=True)
    args = ap.parse_args()
    models = build_model(args.model, args.layout, load_weights=True)
    rs = Resharder(models, bucket_bytes=args.bucket_bytes)
    tensors, buckets, held = {}, [], 0
    for b in rs.buckets():
        assert rs.is_stage_head, "a rank other than the stage head received a bucket"
        held = max(held, b.nbytes)
        buckets.append({"names": b.names, "nbytes": b.nbytes})
        for n, t in zip(b.names, b.tensors):
            assert n not in tensors, f"{n} sent twice"
            tensors[n] = t.contiguous()
    if rs.is_stage_head:
        os.makedirs(args.out, exist_ok=True)
        save_file(tensors, f"{args.out}/stage{rs.pp_rank}.safetensors")
        with open(f"{args.out}/stage{rs.pp_rank}.json", "w") as f:
            json.dump({"buckets": buckets, "max_bucket_bytes": held, "rank": dist.get_rank(),
                       "tp": mpu.get_tensor_model_parallel_world_size(),
                       "ep": mpu.get_expert_model_parallel_world_size(),
                       "vpp": mpu.get_virtual_pipeline_model_parallel_world_size() or 1}, f)
    destroy_parallel_state()


if __name__ == "__main__":
    main()
