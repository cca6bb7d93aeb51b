"""Fixes from Megatron-Core releases after 0.16.1, applied to 0.16.1 (which we stay on: later releases need Python
3.12). Each names the upstream change; an upgrade that carries it drops the patch here. CPU and GPU alike.

Expert gradients under mixed layouts (NVIDIA/Megatron-LM#5916, merged 2026-07, in 0.19+; its EP=1 half also
#6080). 0.16.1 marks an expert parameter `allreduce=False` (its gradient reduced over the expert-data-parallel group,
in DDP's expert buffers and the expert optimizer) only when EP > 1. With EP = 1 and ETP != TP the experts are
replicated over a different set of ranks than the dense weights, yet 0.16.1 reduces their gradients over the dense
data-parallel group: at TP2 x ETP1 (EP1) the two TP ranks each keep the expert gradient of their own half of the
tokens, never summed, so their expert weights drift apart from the first step and the gradient norm is a sum of
two halves' squares (measured on the tiny Qwen3-MoE: replicas differ after one step, the norm 7e-3 off by step
2; tests/dist/test_layout_parity.py). The upstream predicate, `is_expert and (EP > 1 or ETP != TP)`, is set on
the built model here, before DDP sorts parameters into buffers.

The gradient norm's duplicate filter (`param_is_not_tensor_parallel_duplicate`, same upstream change) counts a
parameter not split over TP on TP rank 0 only. An expert parameter is replicated over the expert-TP group, not
the TP group: one not marked tensor-parallel (Transformer Engine's grouped GEMM at ETP 1) was dropped on TP ranks
> 0, whose experts are other experts when EP > 1. Expert parameters are filtered by their expert-TP rank here.

Selective recompute without Transformer Engine. `tensor_parallel.CheckpointWithoutOutput(fp8=False)` sets
`self.fp8 = fp8 is not None`, True for its own default, and its forward then calls Transformer Engine's
`FP8GlobalStateManager`: with `trainer.recompute=selective` over layernorm, mlp or moe_act, every forward failed with
NameError where TE is not installed (a CPU run; a GPU run on the local spec). Here `False` means what it says; the
callers that pass `config.fp8` (None when off) are read as before.

Full recompute of an MTP layer on packed sequences (ours; no upstream change known to us).
`MultiTokenPredictionLayer._checkpointed_forward` hands every keyword argument to `tensor_parallel.checkpoint`, whose
`save_for_backward` refuses `packed_seq_params` (not a tensor): `trainer.recompute=full` with an MTP layer failed at
the first step. The non-tensor arguments are bound to the layer's function here and only tensors go through.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

_APPLIED = False


def mark_expert_gradients(models: Sequence[torch.nn.Module]) -> int:
    """Expert parameters reduce over the expert-data-parallel group whenever ETP != TP (0.16.1: only when EP > 1).
    Returns how many parameters were re-marked. Call before DistributedDataParallel wraps the models."""
    from megatron.core import parallel_state as mpu

    tp, etp = mpu.get_tensor_model_parallel_world_size(), mpu.get_expert_tensor_parallel_world_size()
    if mpu.get_expert_model_parallel_world_size() > 1 or etp == tp:
        return 0
    n = 0
    for m in models:
        for name, p in m.named_parameters():
            if ".experts." in name and getattr(p, "allreduce", True):
                p.allreduce = False
                n += 1
    return n


def _expert_aware(original: Any) -> Any:
    @functools.wraps(original)
    def param_is_not_tensor_parallel_duplicate(param: Any, tp_group: Any = None) -> bool:
        if getattr(param, "allreduce", True) is False and not getattr(param, "tensor_model_parallel", False):
            from megatron.core import parallel_state as mpu

            return mpu.get_expert_tensor_parallel_rank() == 0
        return original(param, tp_group) if tp_group is not None else original(param)

    param_is_not_tensor_parallel_duplicate._mega_async_fix = True
    return param_is_not_tensor_parallel_duplicate


def apply_mcore_fixes() -> None:
    """The gradient norm's duplicate filter, expert-aware, wherever 0.16.1 reads it (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    import importlib

    layers = importlib.import_module("megatron.core.tensor_parallel.layers")
    fixed = _expert_aware(layers.param_is_not_tensor_parallel_duplicate)
    for mod in ("megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel",
                "megatron.core.optimizer.clip_grads"):
        m = importlib.import_module(mod)
        if hasattr(m, "param_is_not_tensor_parallel_duplicate"):
            m.param_is_not_tensor_parallel_duplicate = fixed
    mtp = importlib.import_module("megatron.core.transformer.multi_token_prediction")
    layer = getattr(mtp, "MultiTokenPredictionLayer", None)
    if layer is not None and hasattr(layer, "_checkpointed_forward"):
        layer._checkpointed_forward = _tensors_through_checkpoint(layer._checkpointed_forward)
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    cls = getattr(random, "CheckpointWithoutOutput", None)
    if cls is not None:
        cls.__init__ = _fp8_false_is_off(cls.__init__)
    _APPLIED = True


def _tensors_through_checkpoint(checkpointed: Any) -> Any:
    """An MTP layer's full recompute with only tensors (and None) as the checkpoint's arguments."""

    @functools.wraps(checkpointed)
    def fixed(self: Any, forward_func: Any, *args: Any, **kwargs: Any) -> Any:
        names = [k for k, v in kwargs.items() if v is None or isinstance(v, torch.Tensor)]
        if self.config.fp8 or len(names) == len(kwargs):
            return checkpointed(self, forward_func, *args, **kwargs)
        bound = {k: v for k, v in kwargs.items() if k not in names}

        def call(*a: Any) -> Any:  # the checkpoint passes the tensors positionally: back to their names
            return forward_func(*a[:len(args)], **dict(zip(names, a[len(args):])), **bound)

        return checkpointed(self, call, *args, **{k: kwargs[k] for k in names})

    return fixed


def _fp8_false_is_off(init: Any) -> Any:
    """CheckpointWithoutOutput(fp8=False) without FP8 (0.16.1 reads `fp8 is not None`)."""

    @functools.wraps(init)
    def fixed(self: Any, fp8: Any = False) -> None:
        init(self, fp8)
        if fp8 is False:
            self.fp8 = False

    return fixed
