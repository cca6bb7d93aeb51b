"""The staleness rule (AReaL Eq. 3): admit a rollout only while no sample can end up more than
`max_staleness` versions old when trained on.

capacity = min(max_concurrent - running, (max_staleness + version + 1) * B - (accepted + running))
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Optional

from mega_async.api.types import Version, WeightVersion, writable


@dataclass
class RolloutStat:
    enqueued: int = 0  # waiting for admission
    submitted: int = 0  # ever admitted
    running: int = 0
    accepted: int = 0  # finished and kept (counts toward the staleness budget)
    rejected: int = 0  # finished and dropped (returns its budget)


class StalenessManager:
    """Thread-safe bookkeeping of the capacity rule. B = `consumer_batch_size` (groups per step)."""

    def __init__(self, max_concurrent_rollouts: int, consumer_batch_size: int, max_staleness: int,
                 version: Optional[Version] = None):
        if max_concurrent_rollouts < 1 or consumer_batch_size < 1 or max_staleness < 0:
            raise ValueError(
                f"StalenessManager needs max_concurrent_rollouts >= 1, consumer_batch_size >= 1, max_staleness >= 0; "
                f"got {max_concurrent_rollouts}, {consumer_batch_size}, {max_staleness}"
            )
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.consumer_batch_size = consumer_batch_size
        self.max_staleness = max_staleness
        self._lock = threading.Lock()
        self._stat = RolloutStat()
        self._version = version if version is not None else WeightVersion()  # read, owned by the weight sync

    @property
    def version(self) -> int:
        return self._version.value

    def set_version(self, v: int) -> None:
        """For drivers without a weight sync (a run's sync writes the version this manager reads)."""
        writable(self._version, "StalenessManager.set_version").set(v)

    def on_version_recovered(self, v: int) -> None:
        """After resuming from a checkpoint at version v, v*B groups were already consumed.

        Without this, accepted restarts at 0 and capacity balloons to (eta + v + 1) * B.
        """
        with self._lock:
            if self._version.value != v:  # a run's sync restored the version itself already
                writable(self._version, "StalenessManager.on_version_recovered").set(v)
            self._stat.accepted = v * self.consumer_batch_size

    @property
    def enqueued(self) -> int:
        """Items waiting for admission (cheap: read on every submit)."""
        with self._lock:
            return self._stat.enqueued

    def get_capacity(self) -> int:
        with self._lock:
            return self._capacity_locked()

    def _capacity_locked(self) -> int:
        s = self._stat
        concurrency = self.max_concurrent_rollouts - s.running
        staleness = (self.max_staleness + self._version.value + 1) * self.consumer_batch_size - (s.accepted + s.running)
        return min(concurrency, staleness)

    def try_submit(self) -> int | None:
        """Atomically check capacity and admit one enqueued rollout.

        Returns the version at admission (the rollout's head version), or None when there is no room.
        """
        with self._lock:
            if self._capacity_locked() <= 0:
                return None
            self._submit_locked()
            return self._version.value

    def on_enqueued(self) -> None:
        with self._lock:
            self._stat.enqueued += 1

    def on_submitted(self) -> None:
        with self._lock:
            self._submit_locked()

    def _submit_locked(self) -> None:
        s = self._stat
        s.enqueued = max(0, s.enqueued - 1)
        s.submitted += 1
        s.running += 1

    def on_accepted(self) -> None:
        with self._lock:
            self._finish_locked()
            self._stat.accepted += 1

    def on_rejected(self) -> None:
        with self._lock:
            self._finish_locked()
            self._stat.rejected += 1

    def _finish_locked(self) -> None:
        if self._stat.running <= 0:
            raise RuntimeError("a rollout finished that was never submitted (running would go negative)")
        self._stat.running -= 1

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**asdict(self._stat), "version": self._version.value, "capacity": self._capacity_locked()}
