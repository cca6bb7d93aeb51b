"""GLM-4.5 / 4.6 MoE (transformers' Glm4MoeForCausalLM, model_type glm4_moe) through mbridge's GLM4MoEBridge.

Shared experts, sigmoid routing with `e_score_correction_bias`, `routed_scaling_factor`, `first_k_dense_replace`
dense layers, partial rotary (`partial_rotary_factor`, rotate-half on the first part of each head), q/k/v bias
(`attention_bias`), optional q/k norms (`use_qk_norm`). What this adds to mbridge:
- `partial_rotary_factor` from transformers 5's rope_parameters (mbridge reads the top-level field);
- q/k/v bias as the config says (mbridge always builds it); the shared expert's width is
  moe_intermediate_size x n_shared_experts as transformers builds it (mbridge drops the factor);
- group-limited routing and the refusals of `SigmoidRouted` (MTP layers, norm_topk_prob false).
"""
from __future__ import annotations

from typing import Any

from mega_async.bridge.family import SigmoidRouted, _rope


class Glm4Moe(SigmoidRouted):
    model_types = ("glm4_moe",)

    def prepare(self, hf: Any) -> Any:
        hf = super().prepare(hf)
        if getattr(hf, "partial_rotary_factor", None) is None:
            hf.partial_rotary_factor = float(_rope(hf).get("partial_rotary_factor", 1.0))
        return hf

    def overrides(self, hf: Any, use_te: bool) -> dict[str, Any]:
        out = super().overrides(hf, use_te)
        out.update(add_qkv_bias=bool(getattr(hf, "attention_bias", False)),
                   moe_shared_expert_intermediate_size=int(hf.moe_intermediate_size) * int(hf.n_shared_experts) or None)
        return out

    def model_args(self, hf: Any) -> dict[str, Any]:
        return {"rotary_percent": float(hf.partial_rotary_factor)}
