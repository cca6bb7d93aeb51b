"""Run metrics: the stat names of a training step, one JSONL line per step, TensorBoard scalars, and GPU
memory/utilisation through nvidia-ml-py when a GPU is present.

Names: `reward_mean` (over every generated group, filtered or not), `batch_reward_mean` (the trained
batch), `train/*` (engine), `sync/*` (weight sync), `executor/*` (staleness manager and executor),
`filter/*` (dynamic filter), `router/*` (generation through a router: answers through it, around it), `gpu/*`,
and the timings `rollout_wait_s`, `train_s`, `step_s`, `elapsed_s`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

from mega_async.utils.diskspace import append_line

logger = logging.getLogger("mega_async.run.metrics")


class RewardTracker:
    """Mean reward of the groups generated since the last call (the dynamic filter sees them all)."""

    def __init__(self, flt: Any = None):
        self.flt = flt
        self._seen = (0.0, 0)

    def since_last(self, fallback: float) -> float:
        if self.flt is None:
            return fallback
        d_sum, d_n = self.flt.reward_sum - self._seen[0], self.flt.reward_count - self._seen[1]
        self._seen = (self.flt.reward_sum, self.flt.reward_count)
        return d_sum / d_n if d_n else fallback

    def state_dict(self) -> dict[str, float]:
        return {"sum": self._seen[0], "count": self._seen[1]}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._seen = (float(state["sum"]), int(state["count"]))


def gpu_stats() -> dict[str, float]:
    """Memory and utilisation of this process's GPU (empty without CUDA or nvidia-ml-py)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return {}
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        mem, util = pynvml.nvmlDeviceGetMemoryInfo(h), pynvml.nvmlDeviceGetUtilizationRates(h)
        return {"gpu/mem_used_gib": mem.used / 2**30, "gpu/util_pct": float(util.gpu),
                "gpu/torch_max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30}
    except Exception:  # noqa: BLE001 - metrics never stop a run
        return {}


class Metrics:
    """Writes `<run_dir>/metrics.jsonl` (and TensorBoard under `<run_dir>/tensorboard`) on the rank that
    owns it; other ranks get a Metrics with `enabled=False` that writes nothing. Each step's line goes out whole
    or not at all: a full disk raises DiskFull naming the file, which never ends in a torn line."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, enabled: bool = True, purge_step: Optional[int] = None):
        self.enabled = enabled
        self.history: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self._fd: Optional[int] = None
        self._tb = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # after a resume, TensorBoard drops the events of steps >= purge_step that the crashed run wrote
            self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge_step)

    def log(self, step: int, stats: dict[str, Any]) -> dict[str, Any]:
        stat = {"step": step, **stats, **gpu_stats(), "elapsed_s": round(time.monotonic() - self.t0, 3)}
        if not self.enabled:
            return stat
        self.history.append(stat)
        append_line(self._fd, (json.dumps(stat) + "\n").encode(), self.path)
        if self._tb is not None:
            for k, v in stat.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        return stat

    def size(self) -> int:
        """Bytes of metrics.jsonl written so far (a checkpoint records it; a resume truncates back to it)."""
        if self._fd is None:
            return 0
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def prefixed(prefix: str, stats: Optional[dict[str, Any]]) -> dict[str, Any]:
    return {f"{prefix}/{k}": v for k, v in (stats or {}).items()}
