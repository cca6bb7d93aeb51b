"""Routed experts of the embedded server's own forward (SGLang's `return_routed_experts`).

A forward hook on every MoE router records its top-k expert ids (for DeepSeek-V3 / GLM-4.5: what the sigmoid
+ e_score_correction_bias, group-limited top-k picked). SGLang's wire format: meta_info.routed_experts is
base64 of an int32 array [num_tokens, num_hidden_layers, top_k] in C order, num_tokens = prompt + output - 1
(every token that went through a forward; the last sampled token never did).
"""
from __future__ import annotations

import base64
import re
from typing import Any, Optional

import torch


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, top-k router) of each MoE layer, in layer order: transformers' Qwen3-MoE
    `*TopKRouter` and DeepSeek-V3 / GLM-4.5 `*TopkRouter` modules (forward -> logits, weights, ids)."""
    out = []
    for name, m in model.named_modules():
        if type(m).__name__.lower().endswith("topkrouter") and hasattr(m, "top_k"):
            layer = _LAYER.search(name)
            if layer is None:
                raise ValueError(f"router {name} is not inside a decoder layer (model.layers.<i>)")
            out.append((int(layer[1]), m))
    return sorted(out, key=lambda x: x[0])


class RouteRecorder:
    """Records router top-k ids of each forward while `active`; `take(B, S)` gives [B, S, layers, k].

    As SGLang's capturer: one row per decoder layer (num_hidden_layers), zeros for dense layers (DeepSeek-V3's
    `first_k_dense_replace`); each token's k experts ordered by the router's weight, largest first (the unbiased
    score: DeepSeek-V3's correction bias changes which experts are picked, not their weights), so slot 0 is the
    top-1 expert the trainer's routing statistics compare."""

    def __init__(self, model: torch.nn.Module) -> None:
        found = find_routers(model)
        self.num_layers = int(getattr(model.config, "num_hidden_layers", 0) or 0) or (max(
            (i for i, _ in found), default=-1) + 1)
        found = [(i, r) for i, r in found if i < self.num_layers]  # an MTP layer's router (kept, not run) has no row
        self.layers = [i for i, _ in found]
        self.routers = [r for _, r in found]
        self.top_k = int(self.routers[0].top_k) if self.routers else 0
        self.active = False
        self._ids: dict[int, torch.Tensor] = {}
        self._handles = [r.register_forward_hook(self._hook_for(i)) for i, r in found]

    def _hook_for(self, layer: int) -> Any:
        def hook(module: Any, args: Any, out: Any) -> None:
            if self.active:
                weights, ids = out[1], out[2]
                order = torch.sort(weights.detach().float(), dim=-1, descending=True, stable=True).indices
                self._ids[layer] = ids.detach().gather(-1, order).to("cpu", torch.int32)
        return hook

    def start(self) -> None:
        self._ids = {}
        self.active = bool(self.routers)

    def take(self, batch: int, seq: int) -> Optional[torch.Tensor]:
        self.active = False
        ids, self._ids = self._ids, {}
        if not self.routers or len(ids) != len(self.routers):
            return None
        out = torch.zeros(self.num_layers, batch * seq, self.top_k, dtype=torch.int32)
        for layer, t in ids.items():
            out[layer] = t.reshape(batch * seq, self.top_k)
        return out.reshape(self.num_layers, batch, seq, self.top_k).permute(1, 2, 0, 3)


def encode_routes(routes: torch.Tensor) -> str:
    """base64 of the int32 array [tokens, layers, top_k], as SGLang's detokenizer encodes it."""
    return base64.b64encode(routes.to(torch.int32).contiguous().numpy().tobytes()).decode("utf-8")
