"""Packed (THD) attention for Megatron's local layer spec, so 1-D packed micro-batches run on CPU.

Megatron's local DotProductAttention rejects `packed_seq_params` and context parallelism; on GPU
Transformer Engine handles both (THD with its own CP attention). This subclass keeps the local path for
ordinary [s, b] inputs and, for packed input, runs causal scaled-dot-product attention sequence by
sequence along `cu_seqlens`. With context parallelism each rank holds chunks r and 2cp-1-r of every
sequence (Megatron's load-balanced layout, `packing.cp_partition_index`); K and V are all-gathered over
the CP group (reduce-scattered in backward) and each local query attends to the keys before it.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

from mega_async.algo.packing import cp_partition_index


class _GatherOverCP(torch.autograd.Function):
    """All-gather along dim 0 over the CP group; backward reduce-scatters (each rank's slice gets the sum of
    every rank's gradient for it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = torch.empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        n = dist.get_world_size(ctx.group)
        out = torch.empty((grad.shape[0] // n, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


class PackedDotProductAttention(DotProductAttention):
    def __init__(self, config: Any, *args: Any, k_channels: Optional[int] = None, v_channels: Optional[int] = None,
                 **kwargs: Any):
        # DotProductAttention.__init__ asserts context_parallel_size == 1 (TE only); this class does CP itself.
        # MLA passes its K and V head dims (TE's signature); the local class sizes its output by kv_channels, so
        # it is built with the V head dim (MLA passes its own softmax scale for the K dim)
        cp, kv = config.context_parallel_size, config.kv_channels
        config.context_parallel_size = 1
        if v_channels is not None:
            config.kv_channels = v_channels
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            config.context_parallel_size, config.kv_channels = cp, kv

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        from megatron.core import parallel_state as mpu

        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed attention supports qkv_format='thd', got {packed_seq_params.qkv_format!r}")
        cu_q = packed_seq_params.cu_seqlens_q_padded
        cu_q = packed_seq_params.cu_seqlens_q if cu_q is None else cu_q
        cu_k = packed_seq_params.cu_seqlens_kv_padded
        cu_k = packed_seq_params.cu_seqlens_kv if cu_k is None else cu_k
        # query [t, np, hn]; key/value [t, ng, hn]
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
        p = self.attention_dropout.p if self.training else 0.0
        if mpu.get_context_parallel_world_size() > 1:
            return _cp_attention(query, key, value, cu_q, mpu.get_context_parallel_group(), scale, p)
        key, value = _repeat_kv(query, key, value)
        out = query.new_empty(*query.shape[:-1], value.shape[-1])  # MLA: V head dim != Q/K head dim
        bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
        for i in range(len(bounds_q) - 1):
            qs, qe, ks, ke = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
            if qe == qs:
                continue
            q = query[qs:qe].transpose(0, 1)  # [np, s, hn]
            k = key[ks:ke].transpose(0, 1)
            v = value[ks:ke].transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=scale)
            out[qs:qe] = o.transpose(0, 1)
        return out.reshape(out.shape[0], -1)


def _repeat_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    return key, value


def _cp_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, group: Any,
                  scale: float, p: float) -> torch.Tensor:
    """Causal attention of this CP rank's query chunks against the whole sequences' K/V; `cu` counts the
    full (all-rank) padded sequences, the local stream holds 1/cp of each."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    index = [cp_partition_index(cu.cpu(), cp, j) for j in range(cp)]
    order = torch.empty(int(cu[-1]), dtype=torch.long)
    order[torch.cat(index)] = torch.arange(int(cu[-1]))  # gathered row holding each global position
    kv = _GatherOverCP.apply(torch.cat([key, value], dim=-1), group)[order.to(key.device)]
    key, value = _repeat_kv(query, *kv.split([key.shape[-1], value.shape[-1]], dim=-1))
    mine = index[rank].to(query.device)
    out = query.new_empty(*query.shape[:-1], value.shape[-1])
    bounds = cu.tolist()
    for i in range(len(bounds) - 1):
        s, e = bounds[i], bounds[i + 1]
        if e == s:
            continue
        ls, le = s // cp, e // cp
        q = query[ls:le].transpose(0, 1)  # [np, s/cp, hn]
        k, v = key[s:e].transpose(0, 1), value[s:e].transpose(0, 1)
        allowed = torch.arange(e - s, device=query.device)[None, :] <= (mine[ls:le] - s)[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p, scale=scale)
        out[ls:le] = o.transpose(0, 1)
    return out.reshape(out.shape[0], -1)


def use_packed_attention(spec: Any) -> Any:
    """Swap core_attention for PackedDotProductAttention in a layer spec or a block spec (in place)."""
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        attn = layer.submodules.self_attention
        if attn.submodules.core_attention is DotProductAttention:
            attn.submodules.core_attention = PackedDotProductAttention
    return spec
