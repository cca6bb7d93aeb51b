"""Packed (THD) attention for Megatron's local layer spec, so 1-D packed micro-batches run on CPU.

Megatron's local DotProductAttention rejects `packed_seq_params`; on GPU Transformer Engine handles
THD natively. This subclass keeps the local path for ordinary [s, b] inputs and, for packed input,
runs causal scaled-dot-product attention sequence by sequence along `cu_seqlens`.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedDotProductAttention(DotProductAttention):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        from megatron.core import parallel_state as mpu

        if mpu.get_context_parallel_world_size() > 1:
            raise NotImplementedError("context parallelism with packed sequences needs Transformer Engine's THD "
                                      "attention (GPU); the CPU packed attention has no ring attention")
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed attention supports qkv_format='thd', got {packed_seq_params.qkv_format!r}")
        cu_q = packed_seq_params.cu_seqlens_q_padded
        cu_q = packed_seq_params.cu_seqlens_q if cu_q is None else cu_q
        cu_k = packed_seq_params.cu_seqlens_kv_padded
        cu_k = packed_seq_params.cu_seqlens_kv if cu_k is None else cu_k
        # query [t, np, hn]; key/value [t, ng, hn]
        rep = query.shape[1] // key.shape[1]
        if rep > 1:
            key = key.repeat_interleave(rep, dim=1)
            value = value.repeat_interleave(rep, dim=1)
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(query.shape[-1])
        p = self.attention_dropout.p if self.training else 0.0
        out = torch.empty_like(query)
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


def use_packed_attention(spec: Any) -> Any:
    """Swap core_attention for PackedDotProductAttention in a layer spec or a block spec (in place)."""
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        attn = layer.submodules.self_attention
        if attn.submodules.core_attention is DotProductAttention:
            attn.submodules.core_attention = PackedDotProductAttention
    return spec
