"""Run under torchrun by tests/dist/test_checkpoint.py. `save`: PPO step on batch A, checkpoint, step on batch B.
`load`: restore the checkpoint (possibly at another layout), step on batch B. Rank 0 writes the weights after the
last step, the LR and the RNG draw that follows, so the two paths can be compared."""
import argparse
import json
import os
import random

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from safetensors.torch import save_file

from mega_async.checkpoint.format import load_checkpoint, save_checkpoint
from mega_async.algo.packing import redistribute_groups
from mega_async.api.types import WeightVersion
from mega_async.trainer.engine import EngineConfig, MegatronTrainEngine
from mega_async.trainer.parallel import destroy_parallel_state
from tests.dist.engine_worker import GROUP, synthetic_batch


def share(batch):
    n_groups = batch["input_ids"].shape[0] // GROUP
    tokens = [int(batch["attention_mask"][g * GROUP:(g + 1) * GROUP].sum()) for g in range(n_groups)]
    mine = redistribute_groups(tokens, mpu.get_data_parallel_world_size())[mpu.get_data_parallel_rank()]
    rows = [g * GROUP + j for g in mine for j in range(GROUP)]
    return {k: v[rows] for k, v in batch.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("save", "load"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = EngineConfig.of(lr=0.05, adam_eps=1e-3, grad_clip=0.0, warmup_steps=2, total_steps=10, lr_decay="cosine",
                       prox_logp="recompute")
    eng = MegatronTrainEngine(args.model, args.layout, cfg, version=WeightVersion(1))
    if args.mode == "save":
        torch.manual_seed(123 + dist.get_rank())
        random.seed(5)
        eng.train_batch(share(synthetic_batch(seed=0)))
        save_checkpoint(args.run_dir, 0, eng, version=1, allocation=args.layout, rollout_state={"x": 1})
    else:
        from mega_async.checkpoint.format import latest_checkpoint

        meta = load_checkpoint(latest_checkpoint(args.run_dir), eng)
        assert meta["step"] == 0 and meta["version"] == 1
        if dist.get_rank() == 0:
            assert meta["rollout"] == {"x": 1}
    draw = [random.random(), float(torch.rand(1))]
    stats = eng.train_batch(share(synthetic_batch(seed=1)))
    weights = {k: v.contiguous() for k, v in eng.export_hf_weights()}
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        save_file(weights, f"{args.out}/weights.safetensors")
        with open(f"{args.out}/stats.json", "w") as f:
            json.dump({"lr": stats["lr"], "loss": stats["loss"], "draw": draw}, f)
    destroy_parallel_state()


if __name__ == "__main__":
    main()
