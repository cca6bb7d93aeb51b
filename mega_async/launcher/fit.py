"""Does the model fit? Parameter counts from an HF config and per-GPU memory of the servers (weights) and
of the Megatron trainer (weights, fp32 grads, distributed Adam state). Pure arithmetic, no torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mega_async.allocation import ParallelStrategy

GIB = 2**30
SERVER_WEIGHT_FRACTION = 0.7  # of a GPU for a server's weights; the rest is KV cache and activations
TRAINER_STATE_FRACTION = 0.75  # of a GPU for the trainer's model state; the rest is activations


@dataclass(frozen=True)
class ParamCount:
    dense: int  # embeddings, attention, norms, routers, dense MLPs: split by TP (and PP)
    expert: int  # routed experts: split by EP x ETP (and PP)

    @property
    def total(self) -> int:
        return self.dense + self.expert


def count_params(c: Any) -> ParamCount:
    """Parameters of a (Qwen3/Qwen2/Mixtral-style) decoder from its HF config."""
    h, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or h // heads
    attn = h * heads * hd * 2 + h * kv * hd * 2 + 2 * h  # q, o, k, v projections; input and post norms
    if getattr(c, "attention_bias", False):
        attn += heads * hd + 2 * kv * hd + h
    if c.model_type in ("qwen3", "qwen3_moe"):
        attn += 2 * hd  # q_norm, k_norm
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0
    dense_mlp = 3 * h * c.intermediate_size
    moe_layers = 0
    if experts:
        step = getattr(c, "decoder_sparse_step", 1) or 1
        only = set(getattr(c, "mlp_only_layers", []) or [])
        moe_layers = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
    ffn = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    expert = moe_layers * experts * 3 * h * ffn
    dense = layers * attn + (layers - moe_layers) * dense_mlp + moe_layers * h * experts
    embed = vocab * h * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    return ParamCount(dense + embed + h, expert)  # + final norm


def bytes_per_param(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def server_gib_per_gpu(p: ParamCount, tp: int, dtype: str) -> float:
    """A server's weights per GPU: SGLang splits every layer over its tp ranks (EP inside the TP group)."""
    return p.total * bytes_per_param(dtype) / tp / GIB


def trainer_gib_per_gpu(p: ParamCount, s: ParallelStrategy, dtype: str) -> float:
    """Weights + fp32 grads on every rank, Adam (m, v and fp32 master weights for 16-bit) sharded over DP
    (experts over expert-DP), as Megatron's distributed optimizer keeps them."""
    w = bytes_per_param(dtype)
    opt = 12 if w == 2 else 8
    dense = p.dense / (s.tp * s.pp)
    expert = p.expert / (s.ep * s.etp * s.pp)
    return (dense * (w + 4 + opt / (s.dp * s.cp)) + expert * (w + 4 + opt / max(1, s.edp))) / GIB
