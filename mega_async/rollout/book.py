"""The executor's one book of episodes: every episode not yet consumed, by task id, in one of three states, with the
counts the readiness rule reads derived as it changes. Not thread-safe: the executor holds its lock around it.

    waiting --start(head)--> running --finish(result)--> done --take()--> (consumed)
       \\                        \\--drop()--> (rejected, failed or filtered)
        \\--drop()--> (never admitted)
"""
from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from mega_async.rollout.journal import EpisodeJournal

WAITING, RUNNING, DONE = "waiting", "running", "done"


@dataclass
class Episode:
    data: Any
    tag: Optional[dict]
    workflow: Any
    journal: EpisodeJournal = field(default_factory=EpisodeJournal)
    head: Optional[int] = None  # the version it was admitted under
    state: str = WAITING
    result: Any = None  # done: the accepted result


class EpisodeBook:
    """Episodes by task id; done ones also in a heap by (head version, task id), the order they are handed out in;
    per head version, how many run and how many are done (a handful of live versions: the readiness check is
    O(versions), not O(batch))."""

    def __init__(self) -> None:
        self._episodes: dict[int, Episode] = {}
        self._done: list[tuple[int, int]] = []  # heap of (head, task id)
        self._running_by_head: collections.Counter[int] = collections.Counter()
        self._done_by_head: collections.Counter[int] = collections.Counter()

    def add(self, tid: int, episode: Episode) -> None:
        self._episodes[tid] = episode
        if episode.state == RUNNING:
            self._running_by_head[episode.head] += 1
        elif episode.state == DONE:
            heapq.heappush(self._done, (episode.head, tid))
            self._done_by_head[episode.head] += 1

    def get(self, tid: int) -> Episode:
        return self._episodes[tid]

    def is_running(self, tid: int) -> bool:
        ep = self._episodes.get(tid)
        return ep is not None and ep.state == RUNNING

    def start(self, tid: int, head: int) -> None:
        """waiting -> running under `head` (no batch may overtake it from now on)."""
        ep = self._episodes[tid]
        assert ep.state == WAITING, (tid, ep.state)
        ep.state, ep.head = RUNNING, head
        self._running_by_head[head] += 1

    def finish(self, tid: int, result: Any) -> Episode:
        """running -> done: accepted, ready to be handed out."""
        ep = self._episodes[tid]
        self._leave_running(ep)
        ep.state, ep.result = DONE, result
        heapq.heappush(self._done, (ep.head, tid))
        self._done_by_head[ep.head] += 1
        return ep

    def drop(self, tid: int) -> Optional[Episode]:
        """A waiting or running episode leaves the book (rejected, failed, filtered, or never admitted)."""
        ep = self._episodes.get(tid)
        if ep is None:
            return None
        assert ep.state != DONE, "a done episode leaves only by take()"
        del self._episodes[tid]
        if ep.state == RUNNING:
            self._leave_running(ep)
        return ep

    def _leave_running(self, ep: Episode) -> None:
        assert ep.state == RUNNING, ep.state
        _dec(self._running_by_head, ep.head)

    @property
    def running(self) -> int:
        return sum(self._running_by_head.values())

    @property
    def any_running(self) -> bool:
        return bool(self._running_by_head)

    @property
    def done(self) -> int:
        return len(self._done)

    def ready(self, count: int) -> bool:
        """`count` done episodes can go out: none of them is newer than a still-running episode."""
        if len(self._done) < count:
            return False
        if not self._running_by_head:
            return True
        oldest_running = min(self._running_by_head)
        return sum(n for h, n in self._done_by_head.items() if h <= oldest_running) >= count

    def take(self, count: int) -> list[tuple[int, Episode]]:
        """The `count` oldest done episodes (by head version, then task id), out of the book."""
        out = []
        for _ in range(count):
            _, tid = heapq.heappop(self._done)
            ep = self._episodes.pop(tid)
            _dec(self._done_by_head, ep.head)
            out.append((tid, ep))
        return out

    def __iter__(self) -> Iterator[tuple[int, Episode]]:
        """Every episode by task id (a snapshot's order)."""
        return iter(sorted(self._episodes.items()))


def _dec(counter: collections.Counter, key: int) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]
