"""The per-family hooks of the bridge (what a model family changes in the Megatron config and the name map):
the default Family and the sigmoid-routed MoE base DeepSeek-V3 and GLM-4.5 share."""
from __future__ import annotations

from typing import Any


class UnsupportedModelError(ValueError):
    """The HF config asks for something the trainer cannot build (one line: what, and what to do)."""


class Family:
    """Defaults: Qwen2/Qwen3 (dense and MoE) as mbridge builds them."""

    model_types: tuple[str, ...] = ()

    def check(self, hf: Any) -> None:
        """Raise UnsupportedModelError for what the Megatron model would get wrong or drop."""

    def mbridge(self, hf: Any, dtype: Any) -> Any:
        """mbridge's bridge for this config (its TransformerConfig and HF <-> Megatron name tables)."""
        from mbridge import AutoBridge

        return AutoBridge.from_config(hf, dtype=dtype)

    def prepare(self, hf: Any) -> Any:
        """transformers 5 moved `rope_theta` into rope_parameters and renamed num_experts; mbridge reads both."""
        if getattr(hf, "rope_theta", None) is None:
            hf.rope_theta = _rope(hf).get("rope_theta", 10000.0)
        if getattr(hf, "num_experts", None) is None and getattr(hf, "num_local_experts", None):
            hf.num_experts = hf.num_local_experts
        return hf

    def overrides(self, hf: Any, use_te: bool) -> dict[str, Any]:
        """TransformerConfig fields set over mbridge's for this family."""
        return {}

    def model_args(self, hf: Any) -> dict[str, Any]:
        """Extra GPTModel arguments (beside vocab, sequence length, rope base)."""
        return {}

    def layer_spec(self, spec: Any, use_te: bool) -> Any:
        """Megatron's layer (or block) spec for this family, changed in place where needed."""
        return spec

    def global_name(self, name: str, is_moe: bool) -> str:
        """A local-spec parameter name (global layer number already in place) -> mbridge's name."""
        name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
        if not is_moe:
            name = name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
        return name


def _rope(hf: Any) -> dict:
    return dict(getattr(hf, "rope_parameters", None) or {})


def _config_file(hf: Any) -> str:
    path = getattr(hf, "_name_or_path", "") or ""
    return f"{path}/config.json" if path else "config.json"


class SigmoidRouted(Family):
    """DeepSeek-V3-style MoE (DeepSeek-V3, GLM-4.5): shared experts, sigmoid scores plus
    `e_score_correction_bias` for selection, group-limited top-k, `routed_scaling_factor`, dense first layers."""

    def check(self, hf: Any) -> None:
        where = _config_file(hf)
        mtp = int(getattr(hf, "num_nextn_predict_layers", 0) or 0)
        if mtp and getattr(hf, "tie_word_embeddings", False):
            raise UnsupportedModelError(
                f"{hf.model_type}: num_nextn_predict_layers={mtp} with tie_word_embeddings=true is not supported (the "
                f"MTP layers' head is exported as a copy of an untied lm_head); untie the embeddings or set "
                f"num_nextn_predict_layers to 0 in {where}")
        topk = int(hf.num_experts_per_tok)
        if not getattr(hf, "norm_topk_prob", True) and topk > 1:
            raise UnsupportedModelError(
                f"{hf.model_type}: norm_topk_prob=false is not supported: Megatron's sigmoid router always "
                f"renormalises the top-{topk} weights; use a config with norm_topk_prob true ({where})")
        experts, groups = int(hf.n_routed_experts), int(getattr(hf, "n_group", 1) or 1)
        group_topk = int(getattr(hf, "topk_group", 1) or 1)
        if groups > 1:
            if experts % groups:
                raise UnsupportedModelError(f"{hf.model_type}: n_group={groups} does not divide "
                                            f"n_routed_experts={experts} ({where})")
            if topk % group_topk or topk // group_topk != 2:
                # Megatron ranks groups by the sum of their top-(topk/topk_group) scores, DeepSeek (HF, SGLang) by
                # the sum of their top-2: the two agree only when topk = 2 x topk_group
                raise UnsupportedModelError(
                    f"{hf.model_type}: group-limited routing with num_experts_per_tok={topk}, topk_group={group_topk} "
                    f"is not supported: Megatron scores a group by its top-{topk}/{group_topk} experts, DeepSeek by "
                    f"its top 2; use num_experts_per_tok = 2 x topk_group ({where})")

    def overrides(self, hf: Any, use_te: bool) -> dict[str, Any]:
        groups = int(getattr(hf, "n_group", 1) or 1)
        return dict(
            # group-limited top-k (mbridge leaves it off: every group would be eligible)
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=int(hf.topk_group) if groups > 1 else None,
            moe_router_topk_scaling_factor=float(hf.routed_scaling_factor),
            # multi-token-prediction layers (num_nextn_predict_layers): Megatron's MTP block, sharing the embedding
            # and output layer; the trainer computes their loss itself (mega_async.trainer.mtp)
            mtp_num_layers=int(getattr(hf, "num_nextn_predict_layers", 0) or 0) or None,
            # RL keeps the router's correction bias as the checkpoint has it (the weight sync sends it): no
            # aux-loss-free bias update, no load-balancing loss
            moe_router_bias_update_rate=0.0,
            moe_router_load_balancing_type="none",
            # the shared-expert overlap needs CUDA streams
            moe_shared_expert_overlap=bool(use_te),
        )
