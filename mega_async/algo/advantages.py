"""GRPO-family advantages from per-sequence rewards in prompt groups (sequences of a group are adjacent)."""
from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, method: str = "group", eps: float = 1e-6,
                    reward_scale: float = 1.0, reward_bias: float = 0.0) -> torch.Tensor:
    """Per-sequence advantages.

    group: (r - mean_g) / (std_g + eps); drgrpo: r - mean_g (no std); rloo: r - mean of the others
    in the group; batch: (r - mean) / (std + eps) over the whole batch; none: r as is.
    """
    r = rewards.to(torch.float32) * reward_scale + reward_bias
    if method == "none":
        return r
    if method == "batch":
        return (r - r.mean()) / (r.std(unbiased=False) + eps)
    if r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size}")
    g = r.view(-1, group_size)
    mean = g.mean(dim=1, keepdim=True)
    if method == "group":
        return ((g - mean) / (g.std(dim=1, unbiased=False, keepdim=True) + eps)).flatten()
    if method == "drgrpo":
        return (g - mean).flatten()
    if method == "rloo":
        if group_size < 2:
            raise ValueError("rloo needs group_size >= 2")
        return (g - (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)).flatten()
    raise ValueError(f"method={method!r}: use group, drgrpo, rloo, batch or none")


def token_advantages(seq_advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast [n] sequence advantages over [n, L] tokens, zero where loss_mask is 0."""
    return seq_advantages[:, None].to(torch.float32) * loss_mask.to(torch.float32)


def batch_with_advantages(groups: list[dict[str, torch.Tensor]], method: str = "group", reward_scale: float = 1.0,
                          reward_bias: float = 0.0) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """Each prompt group gets per-sequence `advantages` (group-wise: a group may have lost rejected members;
    `batch` normalises over all groups together). Returns the groups and all rewards."""
    rewards = torch.cat([g["rewards"] for g in groups])
    if method == "batch":
        adv = grpo_advantages(rewards, 1, "batch", reward_scale=reward_scale, reward_bias=reward_bias)
        out, i = [], 0
        for g in groups:
            n = g["rewards"].numel()
            out.append({**g, "advantages": adv[i:i + n]})
            i += n
        return out, rewards
    return [{**g, "advantages": grpo_advantages(g["rewards"], g["rewards"].numel(), method, reward_scale=reward_scale,
                                                reward_bias=reward_bias)} for g in groups], rewards
