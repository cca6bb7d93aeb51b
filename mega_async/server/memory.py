"""/release_memory_occupation and /resume_memory_occupation: really free the weights and the KV cache.

Released weights leave the model: on CUDA each parameter's data moves to host memory (SGLang's
`--enable-weights-cpu-backup`); on CPU it is written to a safetensors file in a private temporary
directory and the tensors are emptied, so the process's memory really drops. Resume restores the exact
values. The KV cache tag frees the prefix cache (no request may run while anything is released).
Both run on the engine thread between two steps; SGLang's rule holds: only when idle (ignoring the
queue while paused).
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from mega_async.server.engine import EngineRefused, GenerationEngine

logger = logging.getLogger("mega_async.server.memory")

TAGS = ("weights", "kv_cache", "cuda_graph")


def parse_tags(body: dict) -> list[str]:
    tags = body.get("tags")
    if tags is None or tags == []:
        return list(TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be a list of strings, got {tags!r}")
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"unknown memory tag {bad[0]!r}: use {', '.join(TAGS)}")
    return tags


def resident_weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class MemoryOccupation:
    """Offloads and restores one engine's weights; `released` lives on the engine (requests check it)."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine
        self._dir: Optional[Path] = None
        self._host: dict[str, torch.Tensor] = {}

    def release(self, tags: list[str]) -> None:
        """Engine thread only."""
        eng = self.engine
        if eng.num_running or (eng.paused is None and eng.num_waiting):
            raise EngineRefused("release_memory_occupation should be called only when server is idle "
                                f"({eng.num_running} running, {eng.num_waiting} waiting requests): pause first")
        if "kv_cache" in tags:
            eng.prefix_cache.clear()
        if "weights" in tags and "weights" not in eng.released:
            self._offload()
        eng.released |= set(tags)
        logger.info("released memory: %s", ", ".join(tags))

    def resume(self, tags: list[str]) -> None:
        """Engine thread only."""
        if "weights" in tags and "weights" in self.engine.released:
            self._restore()
        self.engine.released -= set(tags)
        logger.info("resumed memory: %s", ", ".join(tags))

    def _params(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.engine.model.named_parameters())  # tied weights appear once

    def _offload(self) -> None:
        params = self._params()
        if self.engine.device.type == "cpu":
            self._dir = Path(tempfile.mkdtemp(prefix="mega_async_released_"))
            save_file({n: p.detach().contiguous() for n, p in params.items()}, str(self._dir / "weights.safetensors"))
        else:
            self._host = {n: p.detach().to("cpu", copy=True) for n, p in params.items()}
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _restore(self) -> None:
        params = self._params()
        if self._dir is not None:
            saved = load_file(str(self._dir / "weights.safetensors"))
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        else:
            saved, self._host = self._host, {}
        for n, p in params.items():
            p.data = saved[n].to(self.engine.device)

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
