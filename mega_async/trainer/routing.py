"""Rollout routing replay (R3) and routing-agreement statistics for Megatron MoE routers.

Trajectories carry `routed_experts` [n, L, layers, top_k] (SGLang's `return_routed_experts` rows: position t
holds the experts of the forward at t, the one that sampled token t+1; -1 where no route was recorded). Per
micro-batch the engine hands this rank's positions (its CP chunks) here; each MoE router of the model chunk
about to run gets its layer's rows (its sequence-parallel slice) as Megatron's `RouterReplay` targets
(REPLAY_FORWARD: the top-k ids are the rollout's, the gate probabilities the trainer's own scores at those
ids, so gradients still reach the router). For sigmoid routers with a correction bias (DeepSeek-V3, GLM-4.5) the
bias ranks experts for selection only and group-limited top-k picks the groups: replay takes the rollout's ids
as they are and weights them by the trainer's unbiased sigmoid scores, renormalised and scaled by the
routed_scaling_factor, as the rollout's own forward did. Rows of dense layers (first_k_dense_replace) are
never read. A forward hook on every router counts, per layer, the tokens
whose top-1 expert or whose expert set differs from the rollout's.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


def _routers(model: torch.nn.Module) -> list[Any]:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def moe_layers(config: Any, num_layers: int) -> list[int]:
    """The layers (0-based, global) that have a router, from Megatron's moe_layer_freq (DeepSeek-V3 and GLM-4.5
    keep their first_k_dense_replace layers dense): the per-layer stats name only these."""
    freq = getattr(config, "moe_layer_freq", 1)
    pattern = list(freq) if isinstance(freq, (list, tuple)) else [int(i % freq == 0) for i in range(num_layers)]
    return [i for i, moe in enumerate(pattern) if moe]


class RouteReplay:
    """Routes for one model (its virtual-pipeline chunks): replay targets and agreement counts per layer.
    `replay` may be switched between forwards (every router gets a RouterReplay slot, idle unless set)."""

    def __init__(self, models: list[torch.nn.Module], num_layers: int, replay: bool):
        from megatron.core import parallel_state as mpu
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        self.replay = replay
        self.num_layers = num_layers
        self._action = RouterReplayAction.REPLAY_FORWARD
        self._chunks: dict[int, list[Any]] = {}
        for m in models:
            # an MTP layer's router (layer_number past num_layers) routes on its own: the rollout's routes cover the
            # main model's layers only (SGLang's draft does not return its routes)
            routers = [r for r in _routers(m) if r.layer_number <= num_layers]
            for r in routers:
                if r.router_replay is None:
                    # what moe_enable_routing_replay=True does in TopKRouter.__init__, kept off Megatron's global list
                    r.router_replay = RouterReplay()
                    RouterReplay.global_router_replay_instances.remove(r.router_replay)
                r.register_forward_hook(self._hook)
            self._chunks[id(m)] = routers
        tp = mpu.get_tensor_model_parallel_world_size()
        sp = bool(models and models[0].config.sequence_parallel)
        self._tp, self._tp_rank = (tp, mpu.get_tensor_model_parallel_rank()) if sp else (1, 0)
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(router) -> (routes, weights)
        self.counts = torch.zeros(3, num_layers, dtype=torch.float64)  # tokens, top-1 differs, set differs
        self.moe_layers = moe_layers(models[0].config, num_layers) if models else list(range(num_layers))

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        """The sequence-parallel part of this rank's (CP-local) stream, as the router sees it."""
        n = t.shape[0] // self._tp
        return t[self._tp_rank * n:(self._tp_rank + 1) * n]

    def _chunk(self, model: torch.nn.Module) -> list[Any]:
        while id(model) not in self._chunks and hasattr(model, "module"):
            model = model.module  # DDP / Float16Module wrappers
        return self._chunks.get(id(model), [])

    def before_forward(self, model: torch.nn.Module, routes: torch.Tensor, weights: Optional[torch.Tensor]) -> None:
        """routes [T, layers, k] at this rank's positions (-1 = none); weights [T]: tokens counted in the stats
        (None: no stats for this forward)."""
        routes, w = self._slice(routes), None if weights is None else self._slice(weights)
        known = (routes >= 0).all(-1)  # [T, layers]
        # rows without a rollout route (padding, a sequence's last token) replay experts 0..k-1: they feed no
        # trained position (causal attention, per-token experts)
        fill = torch.arange(routes.shape[-1], dtype=routes.dtype).expand_as(routes)
        target = torch.where(known[..., None], routes, fill).long()
        for r in self._chunk(model):
            layer = r.layer_number - 1
            if layer >= routes.shape[1]:
                raise ValueError(f"routed_experts has {routes.shape[1]} layers; the model's router "
                                 f"{r.layer_number} has none (routes from another model?)")
            if self.replay:
                r.router_replay.clear_indices()
                r.router_replay.set_target_indices(target[:, layer].to(r.weight.device))
                r.router_replay.set_router_replay_action(self._action)
            if w is not None:
                self._pending[id(r)] = (routes[:, layer], w * known[:, layer])

    def after_forward(self, model: torch.nn.Module) -> None:
        for r in self._chunk(model):
            self._pending.pop(id(r), None)
            if r.router_replay.router_replay_action is not None:
                r.router_replay.clear_indices()  # drops the backward-replay list Megatron appends to
                r.router_replay.clear_router_replay_action()

    def _hook(self, module: Any, args: Any, out: Any) -> None:
        pending = self._pending.pop(id(module), None)
        if pending is None:
            return
        routes, w = pending
        probs, routing_map = out
        if routing_map.shape[0] != routes.shape[0]:
            raise RuntimeError(f"router {module.layer_number} saw {routing_map.shape[0]} tokens, routes cover "
                               f"{routes.shape[0]}")
        with torch.no_grad():
            mine = routing_map.detach().cpu()
            p = probs.detach().float().cpu()
            top1 = p.masked_fill(~mine, float("-inf")).argmax(-1)
            ids = routes.clamp(min=0).long()
            theirs = torch.zeros_like(mine)
            theirs.scatter_(1, ids, True)
            if module.score_function == "sigmoid":
                # a sigmoid router's top-k comes unsorted (SGLang's and transformers' biased grouped top-k), and the
                # correction bias ranks selection apart from weight: the rollout's top-1 is the one of its experts
                # the gate weights most (the trainer's gate weights: all the stats have here)
                their_top1 = ids.gather(1, p.gather(1, ids).argmax(-1, keepdim=True)).squeeze(1)
            else:
                their_top1 = routes[:, 0].long()
            w = w.double()
            layer = module.layer_number - 1
            self.counts[0, layer] += w.sum()
            self.counts[1, layer] += (w * (top1 != their_top1)).sum()
            self.counts[2, layer] += (w * (mine != theirs).any(-1)).sum()

    def take_stats(self) -> torch.Tensor:
        """The counts since the last call ([3, layers]: tokens, top-1 differs, expert set differs); reset."""
        c, self.counts = self.counts, torch.zeros_like(self.counts)
        return c
