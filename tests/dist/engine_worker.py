"""Run under torchrun by tests/dist/test_engine.py: one decoupled-PPO train_batch on a fixed synthetic
RL batch at a layout, this DP rank taking its token-balanced share of whole prompt groups.
Rank 0 writes the updated weights (HF names) and the stats."""
import argparse
import json
import os

import torch
import torch.distributed as dist

from mega_async.algo.loss import kl_penalty
from mega_async.algo.packing import redistribute_groups
from mega_async.api.types import WeightVersion
from mega_async.trainer.engine import EngineConfig, MegatronTrainEngine
from mega_async.trainer.parallel import destroy_parallel_state

GROUP = 2


def synthetic_batch(n_groups: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_groups):
        prompt = torch.randint(1, 1000, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)
        for _ in range(GROUP):
            n_out = int(torch.randint(4, 12, (1,), generator=g))
            out = torch.randint(1, 1000, (n_out,), generator=g)
            rows.append((prompt, out))
    L = max(p.numel() + o.numel() for p, o in rows)
    n = len(rows)
    b = {k: torch.zeros(n, L, dtype=dt) for k, dt in [("input_ids", torch.long), ("attention_mask", torch.long),
                                                       ("loss_mask", torch.long), ("logprobs", torch.float32),
                                                       ("versions", torch.long)]}
    b["versions"].fill_(-1)
    for i, (p, o) in enumerate(rows):
        k, m = p.numel(), o.numel()
        b["input_ids"][i, :k + m] = torch.cat([p, o])
        b["attention_mask"][i, :k + m] = 1
        b["loss_mask"][i, k:k + m] = 1
        b["logprobs"][i, k:k + m] = -torch.rand(m, generator=g) * 3 - 5.5  # near log(1/1024)
        b["versions"][i, k:k + m] = torch.randint(0, 2, (m,), generator=g)
    b["advantages"] = torch.randn(n, generator=g)
    return b



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens-per-mb", type=int, default=4096)
    ap.add_argument("--prox", default="recompute")
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--kl-estimator", default="k3")
    ap.add_argument("--steps", type=int, default=1, help="train_batch calls on the same batch")
    args = ap.parse_args()
    from megatron.core import parallel_state as mpu
    from safetensors.torch import save_file

    cfg = EngineConfig.of(lr=0.05, adam_eps=1.0, grad_clip=0.0, max_tokens_per_mb=args.max_tokens_per_mb,
                       prox_logp=args.prox, behav_imp_weight_cap=5.0, eps_clip=0.2, kl_coef=args.kl_coef,
                       kl_estimator=args.kl_estimator)
    eng = MegatronTrainEngine(args.model, args.layout, cfg, version=WeightVersion(2))
    batch = synthetic_batch()
    n_groups = batch["input_ids"].shape[0] // GROUP
    tokens = [int(batch["attention_mask"][g * GROUP:(g + 1) * GROUP].sum()) for g in range(n_groups)]
    mine = redistribute_groups(tokens, mpu.get_data_parallel_world_size())[mpu.get_data_parallel_rank()]
    rows = [g * GROUP + j for g in mine for j in range(GROUP)]
    local = {k: v[rows] for k, v in batch.items()}
    history = []
    for step in range(args.steps):
        if args.kl_coef > 0 and step == args.steps - 1:  # the KL the last step must report, from outside
            cur, ref = eng.compute_logprobs(batch), eng.compute_logprobs(batch, reference=True)
            m = batch["loss_mask"].bool()
            expected = (kl_penalty(cur, ref, args.kl_estimator)[m]).mean().item()
        history.append(eng.train_batch(local))
    stats = {**history[-1], "history": history,  # the layout the step really ran at (jobs share a process)
             "parallel": {"tp": mpu.get_tensor_model_parallel_world_size(),
                          "pp": mpu.get_pipeline_model_parallel_world_size(),
                          "ep": mpu.get_expert_model_parallel_world_size(),
                          "dp": mpu.get_data_parallel_world_size(),
                          "vpp": mpu.get_virtual_pipeline_model_parallel_world_size() or 1}}
    if args.kl_coef > 0:
        stats["expected_kl_ref"] = expected
    weights = {k: v.contiguous() for k, v in eng.export_hf_weights()}
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        save_file(weights, f"{args.out}/stepped.safetensors")
        with open(f"{args.out}/stats.json", "w") as f:
            json.dump(stats, f)
    destroy_parallel_state()


if __name__ == "__main__":
    main()
