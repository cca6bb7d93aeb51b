"""A step's batch onto the trainer ranks: rank 0's groups get their GRPO advantages and are split over the
data-parallel ranks by tokens (whole groups, token-balanced); every rank receives them and keeps its share
(TP/PP/CP peers of a DP rank keep the same share)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass
class StepBatch:
    """This rank's share of a step's batch, the trained batch's mean reward, rank 0's wait for it, and the time
    from the end of that wait to the end of the update (advantages, the DP split and train_batch: `train_s`)."""

    tensors: dict[str, torch.Tensor]
    reward: float
    rollout_wait_s: float = 0.0
    dispatch_s: float = 0.0
    train_s: float = 0.0
    stats: Optional[dict[str, float]] = None  # rank 0: what the optimizer sees (batch_stats)

    def train_on(self, engine: Any) -> dict[str, Any]:
        """engine.train_batch on this rank's share; returns its stats and keeps the time in `train_s`."""
        t0 = time.monotonic()
        stats = engine.train_batch(self.tensors)
        self.train_s = self.dispatch_s + time.monotonic() - t0
        return stats


def share_batch(groups: Optional[list[dict]], algorithm: Any, group: Any = None,
                rollout_wait_s: float = 0.0) -> StepBatch:
    """Every rank calls it; rank 0 passes the step's groups (`algorithm`: the config's algorithm section), the
    others None. `group`: the gloo control group the batch travels on."""
    from megatron.core import parallel_state as mpu

    from mega_async.algo.advantages import batch_with_advantages
    from mega_async.algo.packing import redistribute_groups
    from mega_async.rollout.workflow import GEN_TIME_KEY
    from mega_async.algo.batch import concat_padded
    from mega_async.utils.comm import from_rank0

    payload, stats = None, None
    if groups is not None:
        a = algorithm
        gen_s = [g[GEN_TIME_KEY] for g in groups if GEN_TIME_KEY in g]
        groups = [{k: v for k, v in g.items() if k != GEN_TIME_KEY} for g in groups]
        groups, rewards = batch_with_advantages(groups, a.adv_norm, a.reward_scale, a.reward_bias)
        stats = batch_stats(groups, torch.cat(gen_s) if gen_s else None)
        tokens = [int(g["attention_mask"].sum()) for g in groups]
        payload = (groups, redistribute_groups(tokens, mpu.get_data_parallel_world_size()), float(rewards.mean()),
                   rollout_wait_s)
    groups, shares, reward, wait = from_rank0(payload, group)
    return StepBatch(concat_padded([groups[i] for i in shares[mpu.get_data_parallel_rank()]]), reward, wait,
                     stats=stats)


def batch_stats(groups: list[dict[str, torch.Tensor]], gen_s: Optional[torch.Tensor] = None) -> dict[str, float]:
    """What the optimizer sees in a step's groups (with their advantages): how many groups carry a gradient (not
    all rewards equal: the dynamic filter's forced groups do not), the advantage magnitudes, and the generation
    lengths (output tokens per sequence) and, given each sequence's generation seconds, their long tail."""
    eff = sum(int(g["rewards"].numel() > 1 and bool(g["rewards"].max() - g["rewards"].min() > 1e-6)) for g in groups)
    adv = torch.cat([g["advantages"].reshape(-1).float() for g in groups]).abs()
    lens = torch.cat([g["loss_mask"].sum(1).float() for g in groups])
    out = {"groups": len(groups), "sequences": int(lens.numel()), "effective_groups": eff,
           "effective_frac": eff / max(len(groups), 1), "adv_abs_mean": float(adv.mean()),
           "adv_abs_max": float(adv.max()), "adv_nonzero_frac": float((adv > 1e-6).float().mean()),
           **_spread("gen_len", lens)}
    if gen_s is not None and gen_s.numel():
        out.update(_spread("gen_s", gen_s.float()))
    return out


def _spread(name: str, x: torch.Tensor) -> dict[str, float]:
    """mean, median, p90, max and max / median of a batch's per-sequence values."""
    med = float(x.median())
    return {f"{name}_mean": float(x.mean()), f"{name}_median": med, f"{name}_p90": float(torch.quantile(x, 0.9)),
            f"{name}_max": float(x.max()), f"{name}_max_over_median": float(x.max()) / med if med > 0 else 0.0}


def timed_share(groups: Optional[list[dict]], algorithm: Any, group: Any = None,
                rollout_wait_s: float = 0.0) -> StepBatch:
    """share_batch, with the time it took in the batch's `dispatch_s` (part of the step's train_s)."""
    t0 = time.monotonic()
    batch = share_batch(groups, algorithm, group, rollout_wait_s)
    batch.dispatch_s = time.monotonic() - t0
    return batch
