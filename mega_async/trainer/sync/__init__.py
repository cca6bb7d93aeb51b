"""Weight sync: the trainer's new weights onto the inference servers; the one owner of the weight version.

    push(): [disk: export HF dir] -> pause bracket { [distributed: resharder buckets -> POST + broadcast]
            [disk: servers load the dir] -> version += 1 } -> [verify: probe logprobs equal the trainer's]

    common.py       the error, the HTTP loop thread, the rollout side (ranks agree through utils/comm.py)
    bracket.py      WeightSync: the version, the pause bracket, the one phase runner (push and catch-up); it holds a
                    Transport (prepare, begin, update, commit, end) and shares a SyncContext with it
    servers.py      ServerCalls: rank 0's HTTP side, answers as plain values
    verify.py       after a push: every server serves the new weights (logprob probe or checksums)
    disk.py         DiskTransport / disk_sync (an HF directory per version), ReloadTransport / reload_sync (no trainer)
    distributed.py  BroadcastTransport / distributed_sync (update_weights_from_distributed over a weight-update group)
    build.py        make_sync (from the run config) and run_version (the version a run starts or resumes at)
"""
from mega_async.trainer.sync.bracket import SyncContext, Transport, WeightSync
from mega_async.trainer.sync.build import make_sync, run_version
from mega_async.trainer.sync.common import INTERRUPT_MODES, RolloutSide, SyncError
from mega_async.trainer.sync.disk import DiskTransport, ReloadTransport, disk_sync, reload_sync
from mega_async.trainer.sync.distributed import DATA_PLANES, BroadcastTransport, distributed_sync
from mega_async.trainer.sync.verify import aligned_order

__all__ = ["DATA_PLANES", "BroadcastTransport", "DiskTransport", "INTERRUPT_MODES", "ReloadTransport", "RolloutSide",
           "SyncContext", "SyncError", "Transport", "WeightSync", "aligned_order", "disk_sync", "distributed_sync",
           "make_sync", "reload_sync", "run_version"]
