"""Per-token logprobs and entropy from vocab-parallel logits, never gathering the full vocabulary.

Each TP rank holds logits for its vocabulary slice. Three TP all-reduces give the logprob (max,
sum of exponentials, target logit) and a fourth the entropy. The sums use Megatron's
reduce_from_tensor_model_parallel_region (all-reduce forward, identity backward), which is the
right gradient when every TP rank computes the same loss downstream.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                            with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [..., V/tp] (this rank's slice), labels [...] (global ids) -> logprobs [...] (and entropy [...])."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp = mpu.get_tensor_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1
    x = logits.float() / temperature
    if tp == 1:
        logp_all = torch.log_softmax(x, dim=-1)
        logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
        return logp, ent
    group = mpu.get_tensor_model_parallel_group()
    v_local = x.shape[-1]
    start = mpu.get_tensor_model_parallel_rank() * v_local
    m = x.detach().max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # 1: a constant shift, no gradient needed
    shifted = x - m.unsqueeze(-1)
    e = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(e.sum(-1))  # 2
    lse = torch.log(sum_exp)
    local = labels - start
    inside = (local >= 0) & (local < v_local)
    target = shifted.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1) * inside
    target = reduce_from_tensor_model_parallel_region(target)  # 3
    logp = target - lse
    ent = None
    if with_entropy:
        # H = log Z - T / Z with Z = sum e_j, T = sum e_j s_j: every cross-rank dependence goes through
        # the two reduced sums, so identity-backward reductions give exact local gradients
        t = reduce_from_tensor_model_parallel_region((e * shifted).sum(-1))  # 4
        ent = lse - t / sum_exp
    return logp, ent
