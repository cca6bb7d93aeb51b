"""Weights through a shared directory: the trainer exports an HF checkpoint per version and the servers load it
(DiskWeightSync); or, with no trainer, the servers reload one fixed directory (ReloadWeightSync).
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from mega_async.trainer.sync.bracket import WeightSync
from mega_async.trainer.sync.common import RolloutSide, fp8_block_of
from mega_async.utils.comm import rank
from mega_async.api.types import WeightVersion

logger = logging.getLogger("mega_async.trainer.sync")


class ReloadWeightSync(WeightSync):
    """No trainer: at each version the servers reload one fixed HF directory (the rollout-only driver); the
    latency simulator loads nothing (it reads the version this sync sets)."""

    sends_new_weights = False  # the servers reload one directory: the same weights every time

    def __init__(self, version: WeightVersion, rollout: RolloutSide, path: str, **kw: Any):
        super().__init__([], version, rollout, **kw)
        self.path = str(Path(path).resolve())

    def _update(self, target: int) -> Optional[str]:
        if self.servers is None:
            return None
        try:
            self.servers.call(self.servers.client.update_weights_from_disk(self.path, target,
                                                                           flush_cache=self.flush_cache,
                                                                           timeout=self.timeout),
                              "/update_weights_from_disk")
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return None


class DiskWeightSync(WeightSync):
    """Weights through a shared directory: every version is an HF checkpoint `<root>/v<N>` (each pipeline
    stage head writes its own shards), the servers load it, and only the newest `keep` stay."""

    def __init__(self, models: Sequence[torch.nn.Module], version: WeightVersion, rollout: Optional[RolloutSide],
                 root: str | Path, src_dir: Optional[str] = None, keep: int = 2, weight_format: str = "model_dtype",
                 **kw: Any):
        super().__init__(models, version, rollout, **kw)
        self.fp8_block = fp8_block_of(models, weight_format)
        self.root = Path(root).resolve()
        self.src_dir = src_dir
        self.keep = max(1, keep)
        self.root.mkdir(parents=True, exist_ok=True)
        self._pushing = False
        if self.rollout is not None:
            self.rollout.client.recover = self._recover  # a server back behind loads the current version

    async def _recover(self, address: str) -> None:
        """One server that came back (restarted, or down during a sync) loads the current version's directory.
        While a push runs it waits for it: it is among that push's servers, which load the new version."""
        if self._pushing:
            return
        v = self.version.value
        path = self.path(v)
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: the current version's weights are not on disk (pruned by a newer sync?)")
        await self.rollout.client.update_weights_from_disk(str(path), v, addresses=[address], flush_cache=True,
                                                           timeout=self.timeout)
        logger.info("server %s loaded version %d from %s", address, v, path)

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def _prepare(self, target: int) -> None:
        from mega_async.trainer.weights import save_hf_checkpoint

        t0 = time.perf_counter()
        save_hf_checkpoint(self.models, self.path(target), src_dir=self.src_dir, fp8_block=self.fp8_block,
                           legacy=True)
        self.last = {"export_s": time.perf_counter() - t0}

    def _update(self, target: int) -> Optional[str]:
        if self.servers is None:
            return None
        t0 = time.perf_counter()
        try:
            self.servers.call(self.servers.client.update_weights_from_disk(str(self.path(target)), target,
                                                                           flush_cache=self.flush_cache,
                                                                           timeout=self.timeout),
                              "/update_weights_from_disk")
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        self.last["load_s"] = time.perf_counter() - t0
        return None

    def push(self) -> dict[str, float]:
        self._pushing = True
        try:
            out = super().push()
        finally:
            self._pushing = False
        if rank() == 0:
            self._prune()
        return out

    def _rollback(self) -> Optional[str]:
        """Every server reloads the current version's directory (the model itself at version 0): this works on
        real SGLang too, where a server that loaded the new version has no other way back."""
        if self.servers is None:
            return None
        v = self.version.value
        path = self.path(v) if self.path(v).is_dir() else (Path(self.src_dir) if self.src_dir else None)
        if path is None:
            return super()._rollback()
        bad = self.servers.reload(str(path.resolve()), v, self._targets, self.flush_cache)
        if bad:
            logger.warning("servers %s could not reload version %d from %s", bad, v, path)
            return f"servers {', '.join(bad)} could not reload version {v} from {path} (a server whose own load failed " \
                   "kept its weights)"
        return None

    def _prune(self) -> None:
        v = self.version.value
        for d in self.root.glob("v*"):
            if d.is_dir() and d.name[1:].isdigit() and int(d.name[1:]) <= v - self.keep:
                shutil.rmtree(d, ignore_errors=True)
        for d in self.root.glob("v*.partial*"):
            shutil.rmtree(d, ignore_errors=True)
