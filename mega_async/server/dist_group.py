"""The embedded server's side of a weight-update group (trainer rank 0 broadcasts, server ranks receive).

Built by `mega_async.utils.comm.init_custom_process_group`, the helper SGLang, AReaL, slime and OpenRLHF all use
(TCP rendezvous, `PrefixStore(group_name)`, `_new_process_group_helper`), so a trainer written for real
SGLang joins it unchanged. The default process group is never touched. Broadcasts are
`torch.distributed.broadcast(t, src=0, group=pg)`; teardown is `torch.distributed.destroy_process_group(pg)`.
"""
from __future__ import annotations

import datetime
import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from mega_async.utils.comm import init_custom_process_group

logger = logging.getLogger("mega_async.server.dist_group")


def tcp_init_method(master_address: str, master_port: int) -> str:
    """`tcp://host:port`, with IPv6 literals bracketed (as SGLang's NetworkAddress.to_tcp does)."""
    host = f"[{master_address}]" if ":" in master_address and not master_address.startswith("[") else master_address
    return f"tcp://{host}:{int(master_port)}"


class WeightGroup:
    """One joined weight-update group. `broken` holds the error once a collective on it has failed."""

    def __init__(self, backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                 group_name: str, timeout_s: float = 300.0):
        self.backend, self.rank, self.world_size, self.group_name = backend, rank, world_size, group_name
        self.timeout_s = float(timeout_s)
        self.broken: Optional[str] = None
        self.received = 0  # broadcasts completed on this group (/server_info: what a trainer can attribute by)
        self._pg: Any = init_custom_process_group(backend, tcp_init_method(master_address, master_port), world_size,
                                                  rank, group_name, datetime.timedelta(seconds=self.timeout_s))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Receive (or, at rank `src`, send) one tensor; a failure marks the group broken and re-raises."""
        try:
            dist.broadcast(tensor, src=src, group=self._pg)
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise
        self.received += 1

    def destroy(self) -> None:
        pg, self._pg = self._pg, None
        if pg is None:
            return
        try:
            dist.destroy_process_group(pg)
        except Exception:  # noqa: BLE001 - a broken group may fail to shut down cleanly; it is gone either way
            logger.warning("destroying weight group %r failed", self.group_name, exc_info=True)
