"""Run under torchrun by tests/dist/test_objectives.py: one train_batch with an off-policy objective on the
engine_worker batch; the loss the engine reports is compared with decoupled_ppo_loss on the unpacked rows."""
import argparse
import json
import os

import torch

from mega_async.algo.loss import decoupled_ppo_loss
from mega_async.api.types import WeightVersion
from mega_async.trainer.engine import EngineConfig, MegatronTrainEngine
from mega_async.trainer.parallel import destroy_parallel_state
from tests.dist.engine_worker import synthetic_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--objective", default="token")
    ap.add_argument("--mode", default="cap_mask")
    ap.add_argument("--prox", default="recompute")
    ap.add_argument("--max-tokens-per-mb", type=int, default=24)
    a = ap.parse_args()
    kw = dict(objective=a.objective, imp_weight_mode=a.mode, imp_weight_bounds=(0.5, 2.0), behav_imp_weight_cap=5.0,
              eps_clip=0.2)
    cfg = EngineConfig.of(lr=0.05, adam_eps=1.0, grad_clip=0.0, max_tokens_per_mb=a.max_tokens_per_mb, prox_logp=a.prox,
                       **kw)
    eng = MegatronTrainEngine(a.model, "megatron:d1", cfg, version=WeightVersion(2))
    batch = synthetic_batch()
    batch["advantages"] = torch.randn(batch["input_ids"].shape[0], generator=torch.Generator().manual_seed(1))
    # the same objective outside the engine, on [n, L] rows (position t predicts token t + 1)
    cur = eng.compute_logprobs(batch)
    prox = cur if a.prox == "recompute" else batch["logprobs"]
    mask = batch["loss_mask"].clone()
    mask[:, 0] = 0
    adv = batch["advantages"][:, None].expand_as(cur)
    expected, st = decoupled_ppo_loss(cur, prox, batch["logprobs"], adv, mask, **kw)
    stats = eng.train_batch(batch)
    weights = {k: v.float().sum().item() for k, v in eng.export_hf_weights()}
    os.makedirs(a.out, exist_ok=True)
    with open(f"{a.out}/result.json", "w") as f:
        json.dump({"loss": stats["loss"], "expected": expected.item(), "masked": st["imp_weight_capped_frac"].item(),
                   "engine_masked": stats["imp_weight_capped_frac"], "weights": weights}, f)
    destroy_parallel_state()


if __name__ == "__main__":
    main()
