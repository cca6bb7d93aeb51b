"""Does the model fit? Parameter counts from an HF config and per-GPU memory of the servers (weights) and of the
Megatron trainer per pipeline stage (weights, fp32 grads, distributed Adam state, activations under the recompute
mode). Pure arithmetic, no torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from mega_async.api.allocation import ParallelStrategy
from mega_async.bridge.model_cards import ParamCount, count_params  # noqa: F401 - counted where model cards are checked

GIB = 2**30
SERVER_WEIGHT_FRACTION = 0.7  # of a GPU for a server's weights; the rest is KV cache and activations


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


def server_gib_per_gpu(p: ParamCount, tp: int, dtype: str, fp8: bool = False, attention: int = 0,
                       dp_attention: int = 1) -> float:
    """A server's weights per GPU: SGLang splits every layer over its tp ranks (EP inside the TP group); with DP
    attention of size d the attention (`attention`: its parameters, all layers) is split over tp / d ranks only
    (MLA at d = tp: whole on every GPU). An FP8 checkpoint keeps its linear layers in one byte a weight (the
    128x128 blocks' fp32 scales add 1/4096); embedding and head stay in `dtype`."""
    w = bytes_per_param(dtype)
    per = (1 + 4 / (128 * 128)) if fp8 else w
    wide = p.embed + p.head
    rest = (p.total - wide - attention) * per + wide * w
    return (rest / tp + attention * per / max(1, tp // max(1, dp_attention))) / GIB


def attention_params(c: Any) -> int:
    """Every layer's attention parameters (norms included), as `count_params` counts them."""
    from mega_async.bridge.model_cards import _attention

    return c.num_hidden_layers * _attention(c)


# ---- the trainer per pipeline stage: model state and activations ------------------------------------------------
# of a GPU for the trainer's state and its activations at their peak; the rest is the CUDA context, NCCL's buffers
# and the caching allocator's fragmentation
TRAINER_FIT_FRACTION = 0.9


@dataclass(frozen=True)
class StageFit:
    """One pipeline stage's largest rank: what it holds at the peak of a step (1F1B: stage i holds `in_flight`
    micro-batches' activations before its first backward)."""
    stage: int
    layers: int  # decoder layers (the MTP layer counted on the last stage)
    in_flight: int
    state_gib: float  # weights, fp32 gradients, its shard of Adam's state
    activation_gib: float  # what the micro-batches in flight keep for their backward
    recompute_gib: float = 0.0  # trainer.recompute=full: one chunk's activations rebuilt during its backward

    @property
    def total_gib(self) -> float:
        return self.state_gib + self.activation_gib + self.recompute_gib


def _layer_parts(c: Any, moe: bool) -> dict[str, float]:
    """Activation elements one token leaves for the backward in one decoder layer, by part, before any sharding
    (a flash-attention kernel: the attention keeps Q, K, V and its output, no score matrix). The parts are what
    Megatron's selective recompute names: layernorm (the two norms' outputs, the projections' inputs), core_attn,
    mla_up_proj, mlp, moe (router, routed experts; moe_act their activation), shared_experts."""
    h, heads = c.hidden_size, c.num_attention_heads
    if getattr(c, "kv_lora_rank", None):  # MLA: the latent projections' outputs, then per-head Q, K, V
        q_lora, kv_lora = getattr(c, "q_lora_rank", None) or 0, c.kv_lora_rank
        qk, v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        up = q_lora + kv_lora + c.qk_rope_head_dim  # the up-projections' inputs
        qkv, out = heads * (2 * qk + v), heads * v
    else:
        kv = getattr(c, "num_key_value_heads", None) or heads
        hd = getattr(c, "head_dim", None) or h // heads
        up, qkv, out = 0, (heads + 2 * kv) * hd, heads * hd
    parts = {"input": 2 * h,  # each half's input (the residual stream, kept by its norm)
             "layernorm": 2 * h, "core_attn": qkv + out, "mla_up_proj": up}
    if moe:
        k = getattr(c, "num_experts_per_tok", None) or 1
        ffn_e = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        shared = (getattr(c, "n_shared_experts", None) or 0) * ffn_e + (
            getattr(c, "shared_expert_intermediate_size", None) or 0)
        from mega_async.bridge.model_cards import _experts

        parts["moe"] = _experts(c) + k * (2 * h + 2 * ffn_e)  # router probabilities, permuted tokens, fc1 out
        parts["moe_act"] = k * ffn_e  # the experts' activation output (fc2's input)
        parts["shared_experts"] = 3 * shared
    else:
        parts["mlp"] = 3 * c.intermediate_size
    return parts


def layer_activation_elements(c: Any, moe: bool, recompute: str = "none",
                              modules: Sequence[str] = ("core_attn",)) -> float:
    """Elements per token one decoder layer keeps for the backward under trainer.recompute (full: the layer's
    input only; the recomputed chunk is counted apart)."""
    parts = _layer_parts(c, moe)
    if recompute == "full":
        return float(c.hidden_size)
    dropped = set(modules) if recompute == "selective" else set()
    if "moe" in dropped:
        dropped |= {"moe_act", "shared_experts"}
    keep = sum(v for name, v in parts.items() if name not in dropped)
    if "core_attn" in dropped:  # the checkpoint keeps its inputs (Q, K, V): with flash attention nothing is saved
        keep += parts["core_attn"]
    return float(keep)


def trainer_stage_fits(c: Any, s: ParallelStrategy, dtype: str, tokens_per_mb: int, recompute: str = "none",
                       modules: Sequence[str] = ("core_attn",), recompute_num_layers: int = 1,
                       mtp_layers: Optional[int] = None) -> list[StageFit]:
    """Each pipeline stage's peak on its largest rank: model state (weights and fp32 gradients split as the trainer
    splits them: attention, dense MLPs, shared experts and the vocabulary over TP; MLA's down-projections, the
    routers and the norms whole on every TP rank; routed experts over EP x ETP; Adam's state over DP, experts'
    over expert-DP) and activations (`tokens_per_mb` tokens a micro-batch, split over CP and, sequence parallel,
    over TP; routed tokens top-k times; the logits and their fp32 softmax on the last stage, the MTP layer's
    too). Pure arithmetic from the HF config."""
    from mega_async.bridge.model_cards import _attention, _experts, _moe_layers

    h, L, V, pp = c.hidden_size, c.num_hidden_layers, c.vocab_size, s.pp
    w, act = bytes_per_param(dtype), bytes_per_param(dtype)
    opt = 12 if w == 2 else 8
    E = _experts(c)
    ffn_e = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    shared = 3 * h * ((getattr(c, "n_shared_experts", None) or 0) * ffn_e
                      + (getattr(c, "shared_expert_intermediate_size", None) or 0))
    router = h * E + (E if c.model_type in ("deepseek_v3", "glm4_moe") else 0)
    attn = _attention(c)
    if getattr(c, "kv_lora_rank", None):  # kept whole on every TP rank: q_a, kv_a (with the rope key), their norms
        whole_attn = h * ((getattr(c, "q_lora_rank", None) or 0) + c.kv_lora_rank + c.qk_rope_head_dim) + (
            (getattr(c, "q_lora_rank", None) or 0) + c.kv_lora_rank + 2 * h)
    else:
        whole_attn = 2 * h  # the norms
    mtp = (getattr(c, "num_nextn_predict_layers", None) or 0) if mtp_layers is None else mtp_layers
    tied = bool(getattr(c, "tie_word_embeddings", False))
    tokens = tokens_per_mb / (s.cp * s.tp)  # one rank's share of a micro-batch
    out = []
    for i in range(pp):
        a, b = i * L // pp, (i + 1) * L // pp
        n_moe = _moe_layers(c, b) - _moe_layers(c, a) if E else 0
        n_dense = (b - a) - n_moe
        last = i == pp - 1
        split = n_moe * shared + n_dense * 3 * h * c.intermediate_size + (b - a) * (attn - whole_attn)
        whole = (b - a) * whole_attn + n_moe * router
        split += (V * h if i == 0 else 0) + (V * h if last and not tied else 0) + (V * h if last and tied and pp > 1
                                                                                   else 0)
        whole += h if last else 0  # the final norm
        experts = n_moe * E * 3 * h * ffn_e
        if last and mtp:  # each MTP module: two norms and eh_proj, one (MoE) decoder layer, its head's norm
            split += mtp * (2 * h * h + attn - whole_attn + (shared if E else 3 * h * c.intermediate_size))
            whole += mtp * (3 * h + whole_attn + (router if E else 0))
            experts += mtp * (E * 3 * h * ffn_e if E else 0)
        dense_b = (split / s.tp + whole) * (w + 4 + opt / (s.dp * s.cp))
        state = dense_b + experts / (s.ep * s.etp) * (w + 4 + opt / max(1, s.edp))
        in_flight = pp - i
        per_token = (n_moe * layer_activation_elements(c, True, recompute, modules)
                     + n_dense * layer_activation_elements(c, False, recompute, modules))
        acts = in_flight * per_token * tokens * act
        rebuilt = 0.0
        if recompute == "full":  # one chunk recomputed whole during its backward
            worst = max(layer_activation_elements(c, True) if E else 0, layer_activation_elements(c, False))
            rebuilt = min(recompute_num_layers, b - a) * worst * tokens * act
        if last:  # the logits (vocabulary split over TP) and their fp32 softmax; the MTP layers' own too
            acts += (1 + mtp) * tokens_per_mb / s.cp * V / s.tp * (act + 4)
            acts += mtp * (layer_activation_elements(c, bool(E), recompute, modules) + 2 * h) * tokens * act
        out.append(StageFit(i, b - a + (mtp if last else 0), in_flight, state / GIB, acts / GIB, rebuilt / GIB))
    return out

