"""Does the model fit? Parameter counts from an HF config and per-GPU memory of the servers (weights) and
of the Megatron trainer (weights, fp32 grads, distributed Adam state). Pure arithmetic, no torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mega_async.allocation import ParallelStrategy

GIB = 2**30
SERVER_WEIGHT_FRACTION = 0.7  # of a GPU for a server's weights; the rest is KV cache and activations
TRAINER_STATE_FRACTION = 0.75  # of a GPU for the trainer's model state; the rest is activations


@dataclass(frozen=True)
class ParamCount:
    """Parameters of the main model (what transformers builds and the trainer trains); MTP layers apart."""
    dense: int  # embeddings, attention, norms, routers, dense MLPs, shared experts: split by TP (and PP)
    expert: int  # routed experts: split by EP x ETP (and PP)
    expert_active: int = 0  # the routed experts one token passes through (top-k of each MoE layer)
    embed: int = 0  # the input embedding (a lookup, in `dense`)
    head: int = 0  # the output head (in `dense`; 0 when tied to the embedding)
    mtp: int = 0  # multi-token-prediction layers (num_nextn_predict_layers), not in dense/expert
    mtp_active: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.expert

    @property
    def active(self) -> int:
        """Parameters one token's forward multiplies with: the embedding lookup excluded, the head included
        (DeepSeek's convention for "37B activated")."""
        return self.dense - self.embed + self.expert_active

    @property
    def non_embedding(self) -> int:
        return self.total - self.embed - self.head


def _experts(c: Any) -> int:
    return (getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
            or getattr(c, "n_routed_experts", None) or 0)


def _attention(c: Any) -> int:
    """One layer's attention with its two norms: MLA (DeepSeek-V3: q/kv low-rank projections) or GQA."""
    h, heads = c.hidden_size, c.num_attention_heads
    if getattr(c, "kv_lora_rank", None):
        q_lora, kv_lora = getattr(c, "q_lora_rank", None), c.kv_lora_rank
        nope, rope, v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = h * q_lora + q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
        kv = h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v)  # kv_a (+ rope key), norm, kv_b
        return q + kv + heads * v * h + 2 * h
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or h // heads
    attn = h * heads * hd * 2 + h * kv * hd * 2 + 2 * h  # q, o, k, v projections; input and post norms
    if getattr(c, "attention_bias", False):
        attn += heads * hd + 2 * kv * hd + (0 if c.model_type == "glm4_moe" else h)  # GLM: no o_proj bias
    if c.model_type in ("qwen3", "qwen3_moe") or getattr(c, "use_qk_norm", False):
        attn += 2 * hd  # q_norm, k_norm
    return attn


def _moe_layers(c: Any, layers: int) -> list[bool]:
    if not _experts(c):
        return [False] * layers
    if getattr(c, "first_k_dense_replace", None) is not None:  # DeepSeek-V3, GLM-4.5: dense layers first
        freq = getattr(c, "moe_layer_freq", 1) or 1
        return [i >= c.first_k_dense_replace and i % freq == 0 for i in range(layers)]
    step = getattr(c, "decoder_sparse_step", 1) or 1
    only = set(getattr(c, "mlp_only_layers", []) or [])
    return [i not in only and (i + 1) % step == 0 for i in range(layers)]


def count_params(c: Any) -> ParamCount:
    """Parameters of a Qwen3/Qwen2/Mixtral-, DeepSeek-V3- (MLA, Kimi-K2) or GLM-4.5-style decoder from its
    HF config, as the checkpoint holds them (the router's e_score_correction_bias included)."""
    h, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    experts = _experts(c)
    ffn = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    expert_mlp = 3 * h * ffn
    top_k = getattr(c, "num_experts_per_tok", None) or 0
    shared = (getattr(c, "n_shared_experts", None) or 0) * expert_mlp
    shared += 3 * h * (getattr(c, "shared_expert_intermediate_size", None) or 0)  # Qwen2-MoE
    bias = experts if c.model_type in ("deepseek_v3", "glm4_moe") else 0  # e_score_correction_bias
    router = h * experts + bias + (h if getattr(c, "shared_expert_intermediate_size", None) else 0)
    attn, dense_mlp = _attention(c), 3 * h * c.intermediate_size
    moe = _moe_layers(c, layers)
    n_moe = sum(moe)
    dense = layers * attn + (layers - n_moe) * dense_mlp + n_moe * (router + shared)
    tied = bool(getattr(c, "tie_word_embeddings", False))
    embed, head = vocab * h, 0 if tied else vocab * h
    mtp_layers = getattr(c, "num_nextn_predict_layers", None) or 0
    # each MTP module: enorm, hnorm, eh_proj (2h -> h), one decoder layer (MoE past the dense ones),
    # shared_head.norm; its embedding and head are the main model's
    mtp_base = 3 * h + 2 * h * h + attn + ((router + shared) if experts else dense_mlp)
    mtp = mtp_layers * (mtp_base + experts * expert_mlp)
    return ParamCount(dense + embed + head + h, n_moe * experts * expert_mlp, n_moe * top_k * expert_mlp,
                      embed, head, mtp, mtp_layers * (mtp_base + top_k * expert_mlp))


def bytes_per_param(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def fp8_block_size(c: Any) -> Optional[tuple[int, int]]:
    """The weight block of an FP8 block-quantized checkpoint (DeepSeek-V3's `quantization_config`:
    quant_method fp8, weight_block_size [128, 128]), else None."""
    q = getattr(c, "quantization_config", None) or {}
    if not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
    block = q.get("weight_block_size")
    return (int(block[0]), int(block[1])) if q.get("quant_method") == "fp8" and block else None


def server_gib_per_gpu(p: ParamCount, tp: int, dtype: str, fp8: bool = False) -> float:
    """A server's weights per GPU: SGLang splits every layer over its tp ranks (EP inside the TP group). An FP8
    checkpoint keeps its linear layers in one byte a weight (the 128x128 blocks' fp32 scales add 1/4096);
    embedding and head stay in `dtype`."""
    if not fp8:
        return p.total * bytes_per_param(dtype) / tp / GIB
    wide = p.embed + p.head
    return ((p.total - wide) * (1 + 4 / (128 * 128)) + wide * bytes_per_param(dtype)) / tp / GIB


def trainer_gib_per_gpu(p: ParamCount, s: ParallelStrategy, dtype: str) -> float:
    """Weights + fp32 grads on every rank, Adam (m, v and fp32 master weights for 16-bit) sharded over DP
    (experts over expert-DP), as Megatron's distributed optimizer keeps them."""
    w = bytes_per_param(dtype)
    opt = 12 if w == 2 else 8
    dense = p.dense / (s.tp * s.pp)
    expert = p.expert / (s.ep * s.etp * s.pp)
    return (dense * (w + 4 + opt / (s.dp * s.cp)) + expert * (w + 4 + opt / max(1, s.edp))) / GIB
