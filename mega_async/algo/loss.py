"""Decoupled PPO (AReaL Eq. 5) and the proximal-logprob approximations.

r = exp(logp - prox), w = exp(prox - behav), pg = max(-A r, -A clip(r, 1-eps, 1+eps_high));
tokens with w > cap are masked out of the numerator (the denominator keeps them);
loss = sum(mask * w * pg) / sum(mask). Synchronous PPO is the special case behav = prox.
"""
from __future__ import annotations

from typing import Optional

import torch


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: Optional[float] = None,
    behav_imp_weight_cap: Optional[float] = None,
    dual_clip: Optional[float] = None,
    denominator: Optional[float | torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level decoupled PPO loss over `loss_mask`.

    `denominator` replaces sum(loss_mask) when the mean runs over a larger batch than this call
    sees (micro-batches, DP ranks): pass the global token count to get a global token mean.
    """
    mask = loss_mask.bool()
    n = mask.sum()
    denom = n.clamp(min=1) if denominator is None else denominator
    prox, behav = proximal_logprobs.detach(), behavior_logprobs.detach()
    ratio = torch.exp(logprobs - prox)
    hi = eps_clip if eps_clip_high is None else eps_clip_high
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + hi)
    pg1, pg2 = -advantages * ratio, -advantages * clipped
    pg = torch.maximum(pg1, pg2)
    clip_mask = (pg2 > pg1) & mask
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip={dual_clip} must be > 1")
        pg3 = dual_clip * advantages.abs()  # = -c * A for A < 0
        dual_mask = (advantages < 0) & (pg > pg3) & mask
        pg = torch.where(advantages < 0, torch.minimum(pg, pg3), pg)
    else:
        dual_mask = torch.zeros_like(mask)
    w = torch.exp(prox - behav)
    keep = mask
    if behav_imp_weight_cap is not None:
        keep = mask & (w <= behav_imp_weight_cap)
    per_token = torch.where(keep, w * pg, torch.zeros_like(pg))
    loss = per_token.sum() / denom
    with torch.no_grad():
        nf = n.clamp(min=1).float()
        stats = {
            "n_tokens": n.float(),
            "clip_frac": clip_mask.sum() / nf,
            "dual_clip_frac": dual_mask.sum() / nf,
            "imp_weight_capped_frac": (mask & ~keep).sum() / nf,
            "behav_imp_weight_mean": (w * mask).sum() / nf,
            "behav_imp_weight_max": torch.where(mask, w, torch.zeros_like(w)).max() if n > 0 else w.new_zeros(()),
            "ratio_mean": (ratio * mask).sum() / nf,
            "approx_kl": ((prox - logprobs.detach()) * mask).sum() / nf,
        }
    return loss, stats


def approximate_proximal_logprobs(
    behavior_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    versions: torch.Tensor,
    current_version: int,
    method: str = "loglinear",
) -> torch.Tensor:
    """Proximal logprobs without a forward pass, interpolating between behaviour and current policy.

    alpha = clamp((v - 1 - v_b) / (v - v_b), 0, 1) per token (0 when v == v_b);
    loglinear: prox = lb + alpha (lt - lb); linear: the same in probability space.
    Tokens with version < 0 (prompt) get the behaviour logprob.
    """
    vb = versions.to(torch.float64)
    v = float(current_version)
    gap = v - vb
    alpha = torch.where(gap > 0, ((v - 1 - vb) / gap.clamp(min=1e-12)).clamp(0.0, 1.0), torch.zeros_like(vb))
    alpha = torch.where(versions < 0, torch.zeros_like(alpha), alpha).to(logprobs.dtype)
    lb, lt = behavior_logprobs.detach(), logprobs.detach()
    if method == "loglinear":
        return lb + alpha * (lt - lb)
    if method == "linear":
        return torch.log((1 - alpha) * lb.exp() + alpha * lt.exp())
    raise ValueError(f"method={method!r}: use loglinear or linear")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimates: k1 = log r, k2 = (log r)^2 / 2, k3 = r' - 1 - log r' with r' = ref/pi."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"estimator={estimator!r}: use k1, k2 or k3")
