"""Run under torchrun by tests/dist/test_cp.py: at a layout (with or without context parallelism), the packed
forward's full logits, compute_logprobs of a synthetic RL batch, then one decoupled-PPO train_batch on this
DP rank's share. Rank 0 writes logits, logprobs, the updated weights (HF names) and the stats."""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_worker import GROUP, synthetic_batch  # noqa: E402

from mega_async.algo.packing import redistribute_groups  # noqa: E402
from mega_async.api.types import WeightVersion
from mega_async.trainer.engine import EngineConfig, MegatronTrainEngine  # noqa: E402
from mega_async.trainer.parallel import destroy_parallel_state  # noqa: E402


def full_logits(eng: MegatronTrainEngine, batch: dict) -> torch.Tensor:
    """[n, L, V] logits of the packed forward at each sequence's real tokens, gathered over TP and CP."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    rows = eng._rows(batch)
    mbs = eng._micro_batches(rows, list(range(len(rows))))
    for m in eng.models:
        m.eval()
    with torch.no_grad():
        outs = eng._run(mbs, lambda logits, mb: gather_from_tensor_model_parallel_region(logits).cpu(),
                        forward_only=True)
    for m in eng.models:
        m.train()
    n, L = batch["input_ids"].shape
    res = torch.zeros(n, L, outs[0].shape[-1])
    for out, mb in zip(outs, mbs):
        full = torch.stack([eng._cp_gather(out[:, v].contiguous(), mb) for v in range(out.shape[1])], dim=1)
        for r, s, k in zip(mb.rows, mb.packed.cu_seqlens[:-1].tolist(), mb.packed.lengths):
            res[r, :k] = full[s:s + k]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from megatron.core import parallel_state as mpu
    from safetensors.torch import save_file

    cfg = EngineConfig.of(lr=0.05, adam_eps=1.0, grad_clip=0.0, prox_logp="recompute", behav_imp_weight_cap=5.0)
    eng = MegatronTrainEngine(args.model, args.layout, cfg, version=WeightVersion(2))
    batch = synthetic_batch()
    logits = full_logits(eng, batch)
    logprobs = eng.compute_logprobs(batch)
    n_groups = batch["input_ids"].shape[0] // GROUP
    tokens = [int(batch["attention_mask"][g * GROUP:(g + 1) * GROUP].sum()) for g in range(n_groups)]
    mine = redistribute_groups(tokens, mpu.get_data_parallel_world_size())[mpu.get_data_parallel_rank()]
    rows = [g * GROUP + j for g in mine for j in range(GROUP)]
    stats = eng.train_batch({k: v[rows] for k, v in batch.items()})
    weights = {k: v.contiguous() for k, v in eng.export_hf_weights()}
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        save_file(weights, f"{args.out}/stepped.safetensors")
        save_file({"logprobs": logprobs, "logits": logits},
                  f"{args.out}/forward.safetensors")
        with open(f"{args.out}/stats.json", "w") as f:
            json.dump(stats, f)
    destroy_parallel_state()


if __name__ == "__main__":
    main()
