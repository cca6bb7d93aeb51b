"""`/weights_checker` of the embedded server, as SGLang's `WeightChecker` (utils/weight_checker.py) answers it.

Actions: `checksum` (per tensor: the first 8 bytes of sha256 over its bytes, as SGLang hashes CPU tensors;
per rank: sha256 over the sorted names and their checksums; per engine: sha256 over the ranks'), `snapshot`
(a copy of every weight), `compare` (every weight equals the snapshot, else 400 naming the tensors) and
`reset_tensors` (random values, for testing that a sync really writes every weight). Non-persistent buffers
(rotary caches, `inv_freq`) and names containing a `skip_tensor_list` entry are left out, as in SGLang.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterator, Optional

import torch

from mega_async.server.protocol import BadRequest
from mega_async.api.sglang_releases import SELECTORS, Release

NON_PERSISTENT = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")
ACTIONS = ("checksum", "snapshot", "compare", "reset_tensors")


def tensor_checksum(t: torch.Tensor) -> str:
    """SGLang's `_hash_tensor` on CPU: 16 hex digits of the first 8 bytes of sha256 over the tensor's bytes."""
    t = t.detach().cpu().contiguous()
    digest = hashlib.sha256(memoryview(t.reshape(-1).view(torch.uint8).numpy())).digest()[:8]
    return f"{int.from_bytes(digest, byteorder='big', signed=False):016x}"


def overall_checksum(checksums: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def engine_checksum(per_gpu: list[str]) -> str:
    h = hashlib.sha256()
    for c in per_gpu:
        h.update(c.encode())
    return h.hexdigest()


def parse_check(body: Optional[dict]) -> tuple[str, list[str], str]:
    body = body or {}
    action = body.get("action", "checksum")
    if not isinstance(action, str):
        raise BadRequest(f"action must be a string, got {action!r}")
    skip = body.get("skip_tensor_list") or []
    if not isinstance(skip, list) or not all(isinstance(x, str) for x in skip):
        raise BadRequest(f"skip_tensor_list must be a list of strings, got {skip!r}")
    selector = body.get("selector", "all")
    if selector not in SELECTORS:
        raise BadRequest(f"selector: Input should be 'target', 'draft' or 'all', got {selector!r}")
    allow = body.get("allow_quant_error", False)
    if not isinstance(allow, bool):
        raise BadRequest(f"allow_quant_error must be a boolean, got {allow!r}")
    return action, skip, selector


class WeightChecker:
    """One model's weights (target role only: the embedded server has no draft model)."""

    def __init__(self, model: torch.nn.Module, release: Release) -> None:
        self.model = model
        self.release = release
        self._snapshot: Optional[dict[str, torch.Tensor]] = None

    def _state(self, skip: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if any(p in name for p in NON_PERSISTENT) or any(p in name for p in skip):
                continue
            yield name, t

    def handle(self, action: str, skip: list[str]) -> tuple[bool, str, Optional[list[dict]]]:
        """Engine thread: (success, message, per-rank payload or None)."""
        if action not in ACTIONS:
            return False, f"Unsupported action={action!r}", None
        if action == "checksum":
            checksums = {name: tensor_checksum(t.data) for name, t in self._state(skip)}
            info: dict[str, Any] = dict(role="target", tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0,
                                        pp_size=1, rank=0, size=1)
            if not self.release.sessions:  # 0.5.18-0.5.20: one ParallelismInfo without a role
                info.pop("role")
            return True, "Success.", [{"checksums": checksums, "per_gpu_checksum": overall_checksum(checksums),
                                       "parallelism_info": [info] if self.release.sessions else info}]
        if action == "snapshot":
            self._snapshot = {name: t.detach().clone() for name, t in self._state([])}
            return True, "Success.", None
        if action == "reset_tensors":
            with torch.no_grad():
                for _, t in self._state(skip):
                    if t.dtype.is_floating_point:
                        t.copy_(torch.rand_like(t, dtype=torch.float32).to(t.dtype))
            return True, "Success.", None
        if self._snapshot is None:  # compare
            return False, "no snapshot: call /weights_checker with action snapshot first", None
        bad = [name for name, t in self._state(skip)
               if name in self._snapshot and not torch.equal(self._snapshot[name], t.detach())]
        self._snapshot = None
        if bad:
            return False, f"check tensor equality failed: {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''}", None
        return True, "Success.", None


def reply_body(success: bool, message: str, ranks: Optional[list[dict]]) -> dict:
    body: dict[str, Any] = {"success": success, "message": message}
    if ranks is not None:
        body["ranks"] = ranks
        body["per_engine_checksum"] = engine_checksum([r["per_gpu_checksum"] for r in ranks])
    return body
