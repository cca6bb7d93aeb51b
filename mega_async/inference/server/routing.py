"""Routed experts of the embedded server's own forward (SGLang's `return_routed_experts`).

A forward hook on every MoE router records its top-k expert ids. SGLang's wire format: meta_info.routed_experts
is base64 of an int32 array [num_tokens, num_layers, top_k] in C order, num_tokens = prompt + output - 1
(every token that went through a forward; the last sampled token never did).
"""
from __future__ import annotations

import base64
from typing import Any, Optional

import torch


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k router of each MoE layer, in layer order (transformers' *TopKRouter modules)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")]


class RouteRecorder:
    """Records router top-k ids of each forward while `active`; `take(B, S)` gives [B, S, layers, k]."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = find_routers(model)
        self.top_k = int(self.routers[0].top_k) if self.routers else 0
        self.active = False
        self._ids: list[torch.Tensor] = []
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def _hook(self, module: Any, args: Any, out: Any) -> None:
        if self.active:
            self._ids.append(out[2].detach().to("cpu", torch.int32))

    def start(self) -> None:
        self._ids = []
        self.active = bool(self.routers)

    def take(self, batch: int, seq: int) -> Optional[torch.Tensor]:
        self.active = False
        ids, self._ids = self._ids, []
        if len(ids) != len(self.routers):
            return None
        return torch.stack(ids, 0).reshape(len(ids), batch, seq, self.top_k).permute(1, 2, 0, 3)


def encode_routes(routes: torch.Tensor) -> str:
    """base64 of the int32 array [tokens, layers, top_k], as SGLang's detokenizer encodes it."""
    return base64.b64encode(routes.to(torch.int32).contiguous().numpy().tobytes()).decode("utf-8")
