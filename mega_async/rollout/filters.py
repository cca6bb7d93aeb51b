"""Dynamic filtering (DAPO): groups whose rewards are all equal carry no gradient; drop them.

When (nearly) every group has equal rewards, because the task is solved or the reward is broken,
dropping them all would stall the run forever: after `max_consecutive_drops` drops in a row the
next group is let through anyway (counted as `forced`; its advantages are zero), so every batch
still fills, and the run shows a drop rate near 1 instead of hanging.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

logger = logging.getLogger("mega_async.rollout.filters")


class DynamicFilter:
    """`should_accept` callable for the executor; counts kept and dropped groups."""

    def __init__(self, key: str = "rewards", atol: float = 1e-6, max_consecutive_drops: Optional[int] = 20):
        if max_consecutive_drops is not None and max_consecutive_drops < 1:
            raise ValueError(f"max_consecutive_drops={max_consecutive_drops} must be >= 1 (or None: no limit)")
        self.key = key
        self.atol = atol
        self.max_consecutive_drops = max_consecutive_drops
        self._lock = threading.Lock()
        self.kept = 0
        self.dropped = 0
        self.forced = 0  # all-equal groups let through after max_consecutive_drops drops in a row
        self._run = 0  # drops in a row
        self.reward_sum = 0.0  # over every group seen, kept or not: the policy's real success rate
        self.reward_count = 0

    def __call__(self, traj: dict) -> bool:
        r = torch.as_tensor(traj[self.key], dtype=torch.float32).flatten()
        keep = r.numel() > 1 and bool((r.max() - r.min()) > self.atol)
        with self._lock:
            self.reward_sum += float(r.sum())
            self.reward_count += r.numel()
            if not keep and self.max_consecutive_drops is not None and self._run >= self.max_consecutive_drops:
                keep = True
                self.forced += 1
                if self.forced == 1:
                    logger.warning("dynamic filter: %d groups in a row had equal rewards (task solved or reward "
                                   "broken?); letting such groups through with zero advantage so batches still fill",
                                   self._run)
            if keep:
                self.kept += 1
                self._run = 0
            else:
                self.dropped += 1
                self._run += 1
        return keep

    _STATE = ("kept", "dropped", "forced", "_run", "reward_sum", "reward_count")

    def state_dict(self) -> dict[str, float]:
        """Counters, the drops-in-a-row run included (a checkpoint keeps them; a resume continues them)."""
        with self._lock:
            return {k.lstrip("_"): getattr(self, k) for k in self._STATE}

    def load_state_dict(self, state: dict[str, float]) -> None:
        with self._lock:
            for k in self._STATE:
                setattr(self, k, type(getattr(self, k))(state[k.lstrip("_")]))

    @property
    def stats(self) -> dict[str, float]:
        with self._lock:
            total = self.kept + self.dropped
            return {"kept": self.kept, "dropped": self.dropped, "forced": self.forced,
                    "drop_rate": self.dropped / total if total else 0.0,
                    "reward_sum": self.reward_sum, "reward_count": self.reward_count}
