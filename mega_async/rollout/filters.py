"""Dynamic filtering (DAPO): groups whose rewards are all equal carry no gradient; drop them."""
from __future__ import annotations

import threading

import torch


class DynamicFilter:
    """`should_accept` callable for the executor; counts kept and dropped groups."""

    def __init__(self, key: str = "rewards", atol: float = 1e-6):
        self.key = key
        self.atol = atol
        self._lock = threading.Lock()
        self.kept = 0
        self.dropped = 0
        self.reward_sum = 0.0  # over every group seen, kept or not: the policy's real success rate
        self.reward_count = 0

    def __call__(self, traj: dict) -> bool:
        r = torch.as_tensor(traj[self.key], dtype=torch.float32).flatten()
        keep = r.numel() > 1 and bool((r.max() - r.min()) > self.atol)
        with self._lock:
            self.reward_sum += float(r.sum())
            self.reward_count += r.numel()
            if keep:
                self.kept += 1
            else:
                self.dropped += 1
        return keep

    @property
    def stats(self) -> dict[str, float]:
        with self._lock:
            total = self.kept + self.dropped
            return {"kept": self.kept, "dropped": self.dropped, "drop_rate": self.dropped / total if total else 0.0,
                    "reward_sum": self.reward_sum, "reward_count": self.reward_count}
