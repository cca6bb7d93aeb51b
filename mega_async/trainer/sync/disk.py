"""Weights through a shared directory: the trainer exports an HF checkpoint per version and the servers load it
(`DiskTransport`, `disk_sync`); or, with no trainer, the servers reload one fixed directory (`ReloadTransport`,
`reload_sync`).
"""
from __future__ import annotations

import contextlib
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch

from mega_async.trainer.sync.bracket import SyncContext, Transport, WeightSync
from mega_async.trainer.sync.common import RolloutSide, fp8_block_of
from mega_async.utils.comm import rank
from mega_async.api.types import WeightVersion

logger = logging.getLogger("mega_async.trainer.sync")


def _load(ctx: SyncContext, path: str, target: int) -> Optional[str]:
    """Rank 0: every server of the push loads `path` at version `target`; this rank's error or None."""
    if ctx.servers is None:
        return None
    try:
        ctx.servers.call(ctx.servers.client.update_weights_from_disk(path, target, flush_cache=ctx.flush_cache,
                                                                     timeout=ctx.timeout),
                         "/update_weights_from_disk")
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


class ReloadTransport(Transport):
    """No trainer: at each version the servers reload one fixed HF directory (the rollout-only driver); the
    latency simulator loads nothing (it reads the version the sync sets). `path` may be changed between pushes."""

    sends_new_weights = False  # the servers reload one directory: the same weights every time

    def __init__(self, path: str):
        self.path = str(Path(path).resolve())

    def update(self, target: int) -> Optional[str]:
        return _load(self.ctx, self.path, target)


def reload_sync(version: WeightVersion, rollout: RolloutSide, path: str, **kw: Any) -> WeightSync:
    """The rollout-only driver's sync: the servers reload `path` at each version (`kw`: WeightSync's)."""
    return WeightSync([], version, rollout, ReloadTransport(path), **kw)


class DiskTransport(Transport):
    """Weights through a shared directory: every version is an HF checkpoint `<root>/v<N>` (each pipeline stage
    head writes its own shards), the servers load it, and only the newest `keep` stay."""

    def __init__(self, root: str | Path, src_dir: Optional[str] = None, keep: int = 2,
                 weight_format: str = "model_dtype"):
        self.root = Path(root).resolve()
        self.src_dir = src_dir
        self.keep = max(1, keep)
        self.weight_format = weight_format
        self._pushing = False

    def open(self, ctx: SyncContext) -> None:
        super().open(ctx)
        self.fp8_block = fp8_block_of(ctx.models, self.weight_format)
        self.root.mkdir(parents=True, exist_ok=True)
        if ctx.rollout is not None:
            ctx.rollout.client.recover = self._recover  # a server back behind loads the current version

    async def _recover(self, address: str) -> None:
        """One server that came back (restarted, or down during a sync) loads the current version's directory.
        While a push runs it waits for it: it is among that push's servers, which load the new version."""
        if self._pushing:
            return
        v = self.ctx.version.value
        path = self.path(v)
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: the current version's weights are not on disk (pruned by a newer sync?)")
        await self.ctx.rollout.client.update_weights_from_disk(str(path), v, addresses=[address], flush_cache=True,
                                                               timeout=self.ctx.timeout)
        logger.info("server %s loaded version %d from %s", address, v, path)

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def prepare(self, target: int) -> None:
        from mega_async.trainer.weights import save_hf_checkpoint

        t0 = time.perf_counter()
        save_hf_checkpoint(self.ctx.models, self.path(target), src_dir=self.src_dir, fp8_block=self.fp8_block,
                           legacy=True)
        self.figures = {"export_s": time.perf_counter() - t0}

    def update(self, target: int) -> Optional[str]:
        t0 = time.perf_counter()
        error = _load(self.ctx, str(self.path(target)), target)
        if error is None and self.ctx.servers is not None:
            self.figures["load_s"] = time.perf_counter() - t0
        return error

    @contextlib.contextmanager
    def pushing(self) -> Iterator[None]:
        self._pushing = True
        try:
            yield
        finally:
            self._pushing = False

    def after_push(self) -> None:
        if rank() == 0:
            self._prune()

    def rollback(self, targets: Sequence[str]) -> Optional[str]:
        """Every server reloads the current version's directory (the model itself at version 0): this works on
        real SGLang too, where a server that loaded the new version has no other way back."""
        servers = self.ctx.servers
        if servers is None:
            return None
        v = self.ctx.version.value
        path = self.path(v) if self.path(v).is_dir() else (Path(self.src_dir) if self.src_dir else None)
        if path is None:
            return super().rollback(targets)
        bad = servers.reload(str(path.resolve()), v, targets, self.ctx.flush_cache)
        if bad:
            logger.warning("servers %s could not reload version %d from %s", bad, v, path)
            return f"servers {', '.join(bad)} could not reload version {v} from {path} (a server whose own load failed " \
                   "kept its weights)"
        return None

    def _prune(self) -> None:
        v = self.ctx.version.value
        for d in self.root.glob("v*"):
            if d.is_dir() and d.name[1:].isdigit() and int(d.name[1:]) <= v - self.keep:
                shutil.rmtree(d, ignore_errors=True)
        for d in self.root.glob("v*.partial*"):
            shutil.rmtree(d, ignore_errors=True)


def disk_sync(models: Sequence[torch.nn.Module], version: WeightVersion, rollout: Optional[RolloutSide],
              root: str | Path, src_dir: Optional[str] = None, keep: int = 2, weight_format: str = "model_dtype",
              **kw: Any) -> WeightSync:
    """The sync through `root` (`kw`: WeightSync's: timeout, verify, group, events, interrupt, ...)."""
    return WeightSync(models, version, rollout, DiskTransport(root, src_dir, keep, weight_format), **kw)
