"""The run's weight sync from its config: `trainer.weight_sync` picks disk or distributed, and the sync owns the
version (created here, restored from a checkpoint here, bumped only by a push)."""
from __future__ import annotations

from typing import Any, Optional

from mega_async.api.config import api_key
from mega_async.trainer.sync.bracket import WeightSync
from mega_async.trainer.sync.common import RolloutSide
from mega_async.utils.comm import from_rank0
from mega_async.trainer.sync.disk import disk_sync
from mega_async.trainer.sync.distributed import distributed_sync
from mega_async.api.types import WeightVersion


def run_version(checkpoint_version: Optional[int] = None) -> WeightVersion:
    """A run's weight version: 0, or one short of a checkpoint's (the resume's first push brings the servers to
    the checkpoint's weights and the version back to it)."""
    return WeightVersion(checkpoint_version - 1 if checkpoint_version is not None else 0)


def make_sync(cfg: Any, engine: Any, version: WeightVersion, service: Any = None, executor: Any = None,
              group: Any = None, events: Any = None) -> WeightSync:
    """The weight sync of `trainer.weight_sync` on this trainer rank (rank 0 passes the InferenceService and the
    executor: the rollout side the pause bracket stops; the other ranks learn the servers from it)."""
    t = cfg.trainer
    rollout = RolloutSide(service.engine, executor) if service is not None else None
    kw: dict[str, Any] = dict(
        timeout=t.sync_timeout, verify=engine.compute_logprobs if t.verify_sync else None,
        verify_tol=t.verify_sync_tol, temperature=cfg.rollout.temperature or 1.0, group=group, events=events,
        verify_method=t.verify_sync_method, interrupt=cfg.rollout.interrupt, weight_format=t.sync_weight_format)
    if t.weight_sync == "disk":
        return disk_sync(engine.models, version, rollout, cfg.run_dir / "weights", src_dir=cfg.model.path,
                              keep=t.keep_weight_versions, **kw)
    addresses, gpus = from_rank0((service.addresses, service.gpus_per_server) if service is not None else None, group)
    return distributed_sync(engine.models, version, rollout, addresses, api_key=api_key(cfg),
                                 bucket_bytes=t.sync_bucket_bytes, load_format=t.sync_load_format,
                                 backend=t.sync_backend, gpus_per_server=gpus,
                                 master_address=t.sync_master_address, **kw)
