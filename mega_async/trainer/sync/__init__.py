"""Weight sync: the trainer's new weights onto the inference servers; the one owner of the weight version.

    push(): [disk: export HF dir] -> pause bracket { [distributed: resharder buckets -> POST + broadcast]
            [disk: servers load the dir] -> version += 1 } -> [verify: probe logprobs equal the trainer's]

    common.py       the error, the HTTP loop thread, the rollout side (ranks agree through utils/comm.py)
    bracket.py      WeightSync: the pause bracket and the push protocol (prepare, begin, update, commit, end)
    verify.py       after a push: every server serves the new weights (logprob probe or checksums)
    disk.py         DiskWeightSync (an HF directory per version), ReloadWeightSync (no trainer)
    distributed.py  DistributedWeightSync (update_weights_from_distributed over a weight-update group)
    build.py        make_sync (from the run config) and run_version (the version a run starts or resumes at)
"""
from mega_async.trainer.sync.bracket import WeightSync
from mega_async.trainer.sync.build import make_sync, run_version
from mega_async.trainer.sync.common import INTERRUPT_MODES, RolloutSide, SyncError
from mega_async.trainer.sync.disk import DiskWeightSync, ReloadWeightSync
from mega_async.trainer.sync.distributed import DATA_PLANES, DistributedWeightSync
from mega_async.trainer.sync.verify import aligned_order

__all__ = ["DATA_PLANES", "DiskWeightSync", "DistributedWeightSync", "INTERRUPT_MODES", "ReloadWeightSync",
           "RolloutSide", "SyncError", "WeightSync", "aligned_order", "make_sync", "run_version"]
