"""Rank 0's HTTP side of the weight sync: every call the sync makes to the servers to decide something, each with
the sync's timeout, answered as plain values (addresses, replies, error text). The other trainer ranks hold no
`ServerCalls`; they hear rank 0's decision through `from_rank0`.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Optional, Sequence

from mega_async.trainer.sync.common import SLACK_S, HttpLoop, RolloutSide

logger = logging.getLogger("mega_async.trainer.sync")


class ServerCalls:
    """The servers as rank 0's weight sync asks them: the client's calls run on the sync's HTTP thread (`loop`), each
    allowed SLACK_S beyond the timeout its own requests carry, so their error (which names the server) comes first.
    A simulated fleet's client answers at once (no coroutine): its answer is returned as it is."""

    def __init__(self, rollout: RolloutSide, loop: HttpLoop, timeout: float):
        self.client = rollout.client
        self.executor = rollout.executor
        self.loop = loop
        self.timeout = timeout

    def call(self, result: Any, what: str, factor: float = 1.0) -> Any:
        """Wait for a client call named `what` (`factor` x the sync's timeout, plus SLACK_S)."""
        if not inspect.isawaitable(result):
            return result
        return self.loop.run(result, factor * self.timeout + SLACK_S, what)

    def targets(self, probe: bool = False) -> list[str]:
        """The servers a sync goes to now (the client's `sync_targets`); `probe`: a server that came back since it
        was last tried is asked first and joins."""
        if probe:
            try:
                self.call(self.client.probe_down(), "probing the servers that were down")
            except Exception as e:  # noqa: BLE001 - it stays out of this sync
                logger.warning("probing the servers that were down failed: %s: %s", type(e).__name__, e)
        return [s.address for s in self.client.sync_targets()]

    def still_up(self, pushed: Sequence[str]) -> Optional[list[str]]:
        """Of the servers a push went to, those still up, in their order (None: the push named none, so all)."""
        if not pushed:
            return None
        now = set(self.targets())
        return [a for a in pushed if a in now]

    def lost(self, pushed: Sequence[str]) -> list[str]:
        """Of the servers a failed push went to, those down now or that lost their state (a restarted process)."""
        try:
            behind = set(self.call(self.client.find_behind(self.timeout), "asking the servers for their weight "
                                                                           "versions"))
        except Exception as e:  # noqa: BLE001 - the sync's own error is the one raised
            logger.warning("asking the servers for their weight versions failed: %s: %s", type(e).__name__, e)
            behind = set()
        targets = self.client.sync_targets()
        now = {s.address for s in targets}
        behind |= {s.address for s in targets if s.rejoin}  # restarted since its group was built (found by a refusal)
        return [a for a in pushed if a not in now or a in behind]

    def releases(self) -> list:
        """Each server's SGLang release (None: down), learned once."""
        return self.call(self.client.learn_releases(self.timeout), "asking the servers for their SGLang release")

    def checksums(self, addresses: Optional[list[str]]) -> tuple[list, list]:
        """Each server's /weights_checker checksum reply and its /model_info (None: every server)."""
        replies = self.call(self.client.weights_checksums(self.timeout, addresses), "/weights_checker")
        infos = self.call(self.client.model_info(addresses, timeout=self.timeout), "/model_info")
        return replies, infos

    def server_info(self, addresses: list[str]) -> list[dict]:
        return self.call(self.client.server_info(self.timeout, addresses), "/server_info")

    def generate(self, payloads: list[dict], addresses: list[str]) -> list[tuple[str, dict]]:
        """Every payload on every server of `addresses`: [(address, answer)], servers outer."""
        client, chosen = self.client, set(addresses)
        index = [i for i, a in enumerate(client.addresses) if a in chosen]

        async def all_servers() -> list:
            return list(await asyncio.gather(*(client.generate_on(i, p, timeout=self.timeout)
                                               for i in index for p in payloads)))

        outs = self.call(all_servers(), "the verification probe")
        where = [client.addresses[i] for i in index for _ in payloads]
        return list(zip(where, outs))

    def rollback(self, pushed: Sequence[str]) -> Optional[str]:
        """The servers of a failed push that still answer drop it; returns what went wrong (None: all rolled back).
        One that gave no answer in this sync is not waited for again (back, it is behind: this sync's version never
        reached it, and it gets every weight of the next sync before it serves)."""
        client = self.client
        silent = set(client.silent)
        targets = [a for a in (pushed or client.addresses) if a not in silent]
        try:  # a server may first finish a receive that is failing: allow it its own timeout too
            replies = self.call(client.rollback_weights(timeout=2 * self.timeout, addresses=targets), "rollback",
                                factor=2)
        except Exception as e:  # noqa: BLE001 - the run stops anyway; continue_generation comes next
            logger.warning("rolling back the servers failed: %s: %s", type(e).__name__, e)
            return f"rolling back the servers failed ({type(e).__name__}: {e}): they may serve partial weights"
        if gone := [a for a, r in zip(targets, replies) if r is None] + sorted(silent & set(pushed)):
            logger.warning("server(s) %s not rolled back (no answer): out until they answer again, then behind "
                           "(they get every weight of the next sync before they serve)", ", ".join(gone))
        bad = [s for s, r in zip(targets, replies) if r is not None and not (isinstance(r, dict) and r.get("success"))]
        for server in bad:
            logger.warning("server %s could not roll back this sync: it may serve partially updated weights "
                           "until the next successful sync or a reload", server)
        return (f"servers {', '.join(bad)} could not roll back (no /rollback_weights: real SGLang) and may serve "
                "partially updated weights" if bad else None)

    def reload(self, path: str, version: int, pushed: Sequence[str], flush_cache: bool) -> list[str]:
        """The servers of a failed push that still answer load `path` at `version` (a disk sync's rollback);
        returns those that could not."""
        client = self.client
        silent = set(client.silent)  # gave no answer in this sync: not waited for again (back, it loads the
        targets = [a for a in pushed or client.addresses if a not in silent]  # current version when it answers)
        try:
            replies = self.call(client.update_weights_from_disk(path, version, check=False, flush_cache=flush_cache,
                                                                addresses=targets, timeout=2 * self.timeout),
                                "reloading the current version (rollback)", factor=2)
        except Exception as e:  # noqa: BLE001
            replies = [f"{type(e).__name__}: {e}"] * len(targets)
        return [a for a, r in zip(targets, replies) if not (isinstance(r, dict) and r.get("success"))]

    def continue_all(self) -> None:
        """The servers generate again. Never raises: it runs in `finally`, where an error would replace the sync's
        own. A server that gave no answer in this sync is not waited for again (it is continued when it answers,
        before it is re-admitted); one that times out now is logged by name."""
        try:
            self.call(self.client.continue_generation(timeout=self.timeout), "continue")
        except Exception as e:  # noqa: BLE001
            logger.warning("continuing the servers after the weight sync failed: %s: %s", type(e).__name__, e)
