"""Decoupled PPO (AReaL Eq. 5), its off-policy corrections, GSPO, the proximal-logprob approximations, and the
SFT cross-entropy (`sft_loss`).

r = exp(logp - prox), w = exp(prox - behav), pg = max(-A r, -A clip(r, 1-eps, 1+eps_high));
loss = sum(keep * w * pg) / sum(mask). Synchronous PPO is the special case behav = prox.
How w corrects for the train/rollout mismatch is `imp_weight_mode` (tokens dropped from the
numerator stay in the denominator):
  cap_mask  tokens with w > cap are masked (AReaL's default; cap None = no mask)
  icepop    two-sided token mask: tokens with w outside [low, high] are masked (IcePop)
  seq_mask  sequences whose geometric-mean w lies outside [low, high] are masked whole (+ the cap)
  tis       truncated importance sampling: w = min(w, cap), no token masked
`objective="gspo"` replaces the token ratio by the sequence ratio s = exp(mean_t(logp - prox)),
clipped per sequence (GSPO). A weight is zeroed before it multiplies anything, so an overflowing or
non-finite weight on a masked token never reaches the loss or its gradient.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

IMP_WEIGHT_MODES = ("cap_mask", "icepop", "seq_mask", "tis")
OBJECTIVES = ("token", "gspo")
LOG_RATIO_LIMIT = 20.0


def segment_index(shape: torch.Size, seq_ids: Optional[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, int]:
    """Flat sequence index per token: `seq_ids` (packed streams), the row of a [n, L] batch, or one sequence."""
    if seq_ids is not None:
        if seq_ids.shape != shape:
            raise ValueError(f"seq_ids shape {tuple(seq_ids.shape)} differs from logprobs {tuple(shape)}")
        idx = seq_ids.reshape(-1).to(device=device, dtype=torch.long)
        return idx, int(idx.max()) + 1 if idx.numel() else 0
    if len(shape) == 2:
        return torch.arange(shape[0], device=device).repeat_interleave(shape[1]), shape[0]
    n = math.prod(shape)
    return torch.zeros(n, dtype=torch.long, device=device), 1


def segment_mean(x: torch.Tensor, mask: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """Mean of `x` over the masked tokens of each sequence, broadcast back to every token (0 if none)."""
    flat, m = x.reshape(-1), mask.reshape(-1)
    vals = torch.where(m, flat, torch.zeros_like(flat))
    sums = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, idx, vals)
    counts = torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, idx, m.to(x.dtype))
    return (sums / counts.clamp(min=1))[idx].reshape(x.shape)


def behaviour_weights(
    log_w: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "cap_mask",
    cap: Optional[float] = None,
    bounds: Optional[Sequence[float]] = None,
    seg: Optional[tuple[torch.Tensor, int]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, keep): the behaviour importance weight per token, already 0 wherever keep is False.

    `log_w` = prox - behav. Non-finite log-weights are always dropped (TIS truncates +inf to the cap).
    """
    if mode not in IMP_WEIGHT_MODES:
        raise ValueError(f"imp_weight_mode={mode!r}: use one of {', '.join(IMP_WEIGHT_MODES)}")
    if mode in ("icepop", "seq_mask") and (bounds is None or len(bounds) != 2 or not 0 < bounds[0] < bounds[1]):
        raise ValueError(f"imp_weight_mode={mode} needs bounds [low, high] with 0 < low < high, got {bounds}")
    if mode == "tis" and cap is None:
        raise ValueError("imp_weight_mode=tis needs a cap (behav_imp_weight_cap)")
    log_w = log_w.detach()
    finite = torch.isfinite(log_w)
    if mode == "tis":
        keep = mask & ~torch.isnan(log_w)
        log_w = torch.where(keep, log_w.clamp(max=math.log(cap)), torch.zeros_like(log_w))  # type: ignore[arg-type]
    else:
        keep = mask & finite
        safe = torch.where(keep, log_w, torch.zeros_like(log_w))
        if mode == "icepop":
            lo, hi = math.log(bounds[0]), math.log(bounds[1])  # type: ignore[index]
            keep = keep & (safe >= lo) & (safe <= hi)
        if mode == "seq_mask":
            lo, hi = math.log(bounds[0]), math.log(bounds[1])  # type: ignore[index]
            idx, n = seg if seg is not None else segment_index(log_w.shape, None, log_w.device)
            nonfinite = (mask & ~finite).reshape(-1).to(torch.long)  # such a sequence is dropped whole
            bad = (torch.zeros(n, dtype=torch.long, device=log_w.device).index_add(0, idx, nonfinite) > 0)
            geo = segment_mean(safe, mask & finite, idx, n)
            keep = keep & ~bad[idx].reshape(log_w.shape) & (geo >= lo) & (geo <= hi)
        if cap is not None and mode in ("cap_mask", "seq_mask"):
            keep = keep & (safe <= math.log(cap))
        log_w = torch.where(keep, safe, torch.zeros_like(safe))
    w = torch.where(keep, torch.exp(log_w), torch.zeros_like(log_w))
    return w, keep


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
    imp_weight_mode: str = "cap_mask",
    imp_weight_bounds: Optional[Sequence[float]] = None,
    objective: str = "token",
    seq_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level decoupled PPO loss over `loss_mask` (see the module docstring for the options).

    `denominator` replaces sum(loss_mask) when the mean runs over a larger batch than this call
    sees (micro-batches, DP ranks): pass the global token count to get a global token mean.
    `seq_ids` names each token's sequence in a packed 1-D stream (seq_mask and gspo need sequences;
    without it the rows of a 2-D input are the sequences, a 1-D input is one sequence).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r}: use one of {', '.join(OBJECTIVES)}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1")
    mask = loss_mask.bool()
    n = mask.sum()
    denom = n.clamp(min=1) if denominator is None else denominator
    prox, behav = proximal_logprobs.detach(), behavior_logprobs.detach()
    need_seg = objective == "gspo" or imp_weight_mode == "seq_mask"
    seg = segment_index(logprobs.shape, seq_ids, logprobs.device) if need_seg else None
    # masked tokens (prompt, padding) may hold anything: weights and log-ratios there are 0 before any exp
    ok = mask & torch.isfinite(prox) & torch.isfinite(logprobs.detach())
    w, keep = behaviour_weights(prox - behav, ok, imp_weight_mode, behav_imp_weight_cap, imp_weight_bounds, seg)
    diff = logprobs - prox
    if objective == "gspo":  # one ratio per sequence, over all its valid tokens
        log_ratio = segment_mean(torch.where(ok, diff, torch.zeros_like(diff)), ok, *seg)  # type: ignore[misc]
    else:
        log_ratio = diff
    # beyond +-LOG_RATIO_LIMIT the ratio is clamped (no gradient past it) so exp never overflows
    log_ratio = torch.where(keep, log_ratio, torch.zeros_like(log_ratio)).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    hi = eps_clip if eps_clip_high is None else eps_clip_high
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + hi)
    adv = torch.where(mask, advantages, torch.zeros_like(advantages))
    pg1, pg2 = -adv * ratio, -adv * clipped
    pg = torch.maximum(pg1, pg2)
    clip_mask = (pg2 > pg1) & mask
    dual_mask = torch.zeros_like(mask)
    if dual_clip is not None:
        pg3 = dual_clip * adv.abs()  # = -c * A for A < 0
        dual_mask = (adv < 0) & (pg > pg3) & mask
        pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)
    per_token = torch.where(keep, w * pg, torch.zeros_like(pg))
    loss = per_token.sum() / denom
    return loss, _stats(n, mask, keep, w, ratio, clip_mask, dual_mask, ok, prox, logprobs)


@torch.no_grad()
def _stats(n: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor, w: torch.Tensor, ratio: torch.Tensor,
           clip_mask: torch.Tensor, dual_mask: torch.Tensor, ok: torch.Tensor, prox: torch.Tensor,
           logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Diagnostics of one loss call, as fractions of the `mask` tokens (weights over the kept ones)."""
    nf = n.clamp(min=1).float()
    return {
        "n_tokens": n.float(),
        "clip_frac": clip_mask.sum() / nf,
        "dual_clip_frac": dual_mask.sum() / nf,
        "imp_weight_capped_frac": (mask & ~keep).sum() / nf,
        "behav_imp_weight_mean": w.sum() / keep.sum().clamp(min=1),
        "behav_imp_weight_max": w.max() if w.numel() else w.new_zeros(()),
        "ratio_mean": (ratio * keep).sum() / keep.sum().clamp(min=1),
        "approx_kl": torch.where(ok, prox - logprobs.detach(), torch.zeros_like(prox)).sum() / nf,
    }


def approximate_proximal_logprobs(
    behavior_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    versions: torch.Tensor,
    current_version: int,
    method: str = "loglinear",
) -> torch.Tensor:
    """Proximal logprobs without a forward pass, interpolating between behaviour and current policy.

    alpha = clamp((v - 1 - v_b) / (v - v_b), 0, 1) per token (0 when v == v_b);
    loglinear: prox = lb + alpha (lt - lb); linear: the same in probability space, computed in log
    space (logaddexp) so logprobs below -87 never underflow to -inf. Prompt tokens (version < 0) get lb.
    """
    vb = versions.to(torch.float64)
    v = float(current_version)
    gap = v - vb
    alpha = torch.where(gap > 0, ((v - 1 - vb) / gap.clamp(min=1e-12)).clamp(0.0, 1.0), torch.zeros_like(vb))
    alpha = torch.where(versions < 0, torch.zeros_like(alpha), alpha)
    lb, lt = behavior_logprobs.detach(), logprobs.detach()
    if method == "loglinear":
        a = alpha.to(logprobs.dtype)
        return lb + a * (lt - lb)
    if method == "linear":
        # log((1-a) e^lb + a e^lt); a weight of 0 contributes exactly nothing (never -inf + inf)
        log_a, log_1ma = torch.log(alpha).to(lt.dtype), torch.log1p(-alpha).to(lb.dtype)
        t_b = torch.where(alpha < 1, log_1ma + lb, torch.full_like(lb, -math.inf))
        t_t = torch.where(alpha > 0, log_a + lt, torch.full_like(lt, -math.inf))
        return torch.where(alpha <= 0, lb, torch.where(alpha >= 1, lt, torch.logaddexp(t_b, t_t)))
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


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, denominator: Optional[float] = None,
             label_smoothing: float = 0.0,
             mean_logprobs: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised fine-tuning: cross-entropy of the target tokens, sum(mask * token loss) / denominator (default
    the masked token count; 1.0 gives the token sum the engine's global token mean divides). With
    `label_smoothing` e the token loss is -(1 - e) logp - e mean_logprobs, where `mean_logprobs` is the mean
    log-probability over the whole vocabulary (torch's cross_entropy(label_smoothing=e)). Stats: the mean
    negative log-likelihood of the targets and the fraction of them the policy gives more than half its mass."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if label_smoothing and mean_logprobs is None:
        raise ValueError("label_smoothing needs mean_logprobs (the mean log-probability over the vocabulary)")
    mask = loss_mask.bool()
    tok = -logprobs if not label_smoothing else -(1 - label_smoothing) * logprobs - label_smoothing * mean_logprobs
    tok = torch.where(mask, tok, torch.zeros_like(tok))
    n = mask.sum()
    den = n.clamp(min=1).to(logprobs.dtype) if denominator is None else torch.as_tensor(denominator, dtype=logprobs.dtype)
    with torch.no_grad():
        nf = n.clamp(min=1).to(logprobs.dtype)
        nll = torch.where(mask, -logprobs.detach(), torch.zeros_like(logprobs)).sum() / nf
        stats = {"nll": nll, "likely_frac": ((logprobs.detach() > math.log(0.5)) & mask).sum() / nf}
    return tok.sum() / den, stats


LOG_W_RANGE, LOG_W_STEP = 4.0, 0.01  # behaviour-weight histogram: bins centred on log w = -4, -3.99, ..., 4
LOG_W_BINS = round(2 * LOG_W_RANGE / LOG_W_STEP) + 3  # plus an underflow and an overflow bin
WEIGHT_QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)


def log_weight_histogram(log_w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Counts of log w = prox - behav over the finite `mask` tokens in bins LOG_W_STEP wide centred on
    -LOG_W_RANGE ... LOG_W_RANGE (w = 1 is a centre), plus an underflow (first) and an overflow (last) bin:
    LOG_W_BINS counts, summable over micro-batches and ranks."""
    x = log_w.detach().reshape(-1).double()
    x = x[mask.reshape(-1).bool() & torch.isfinite(x)]
    idx = torch.round((x + LOG_W_RANGE) / LOG_W_STEP).long().clamp(-1, LOG_W_BINS - 2) + 1
    return torch.bincount(idx, minlength=LOG_W_BINS).double().cpu()


def histogram_quantiles(counts: torch.Tensor, qs: Sequence[float] = WEIGHT_QUANTILES) -> dict[float, float]:
    """The weights w at quantiles `qs` of a log_weight_histogram (the bin's centre; the range's end for the
    overflow bins); empty when it counted nothing."""
    total = float(counts.sum())
    if total <= 0:
        return {}
    cdf = torch.cumsum(counts, 0) / total
    out = {}
    for q in qs:
        b = int(torch.searchsorted(cdf, torch.tensor(q, dtype=cdf.dtype)).clamp(max=len(counts) - 1))
        b = min(max(b, 1), len(counts) - 2)  # the overflow bins report the range's ends
        out[q] = math.exp(-LOG_W_RANGE + (b - 1) * LOG_W_STEP)
    return out

