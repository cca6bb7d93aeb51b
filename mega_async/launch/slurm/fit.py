"""Does the model fit? Parameter counts from an HF config and per-GPU memory of the servers (weights) and
of the Megatron trainer (weights, fp32 grads, distributed Adam state). Pure arithmetic, no torch."""
from __future__ import annotations

from typing import Any, Optional

from mega_async.api.allocation import ParallelStrategy
from mega_async.bridge.model_cards import ParamCount, count_params  # noqa: F401 - counted where model cards are checked

GIB = 2**30
SERVER_WEIGHT_FRACTION = 0.7  # of a GPU for a server's weights; the rest is KV cache and activations
TRAINER_STATE_FRACTION = 0.75  # of a GPU for the trainer's model state; the rest is activations


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
