"""The rollout ledger `<run_dir>/rollouts.jsonl`: one line per finished episode, appended as it happens.

Filtered, rejected and failed episodes are written when they finish; accepted ones when a training step
consumes them (the line names the step). A checkpoint records the ledger's size; a resume truncates the
ledger back to it, because everything after it is redone from the checkpoint's state.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Optional

import torch

from mega_async.utils.diskspace import append_line, read_jsonl


def episode_summary(result: Optional[dict]) -> dict[str, Any]:
    """Head version, per-token version range and mean reward of a trajectory dict (empty when None)."""
    if not result or "versions" not in result:
        return {}
    mask = result["loss_mask"].bool() if "loss_mask" in result else result["versions"] >= 0
    v = result["versions"][mask]
    out: dict[str, Any] = {}
    if v.numel():
        out["versions"] = [int(v.min()), int(v.max())]
    if "rewards" in result:
        out["reward"] = round(float(torch.as_tensor(result["rewards"]).float().mean()), 6)
    return out


class Ledger:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fd: Optional[int] = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, tag: Optional[dict], verdict: str, head: Optional[int], result: Optional[dict] = None,
              step: Optional[int] = None, error: Optional[str] = None) -> None:
        line = {**(tag or {}), "head_version": head, **episode_summary(result), "verdict": verdict, "step": step}
        if error:
            line["error"] = error[:300]
        data = (json.dumps(line) + "\n").encode()
        with self._lock:  # unbuffered: a kill -9 loses nothing that was written; whole lines only (a full disk
            append_line(self._fd, data, self.path)  # raises DiskFull naming the file, and leaves no torn line)

    def size(self) -> int:
        with self._lock:
            return os.fstat(self._fd).st_size if self._fd is not None else self.path.stat().st_size

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    @staticmethod
    def truncate(path: str | os.PathLike, size: int) -> None:
        """Cut the ledger back to `size` bytes (what a checkpoint saw); lines after it are redone."""
        p = Path(path)
        if p.exists() and p.stat().st_size > size:
            with p.open("r+b") as f:
                f.truncate(size)


def read_ledger(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The ledger's lines (a torn last line, from a kill mid-write, is skipped)."""
    p = Path(path)
    if not p.exists():
        return []
    return read_jsonl(p)
