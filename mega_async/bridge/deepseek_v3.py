"""DeepSeek-V3 / R1 and Kimi-K2 (model_type deepseek_v3) through mbridge's DeepseekV3Bridge.

Multi-latent attention (q_lora_rank, kv_lora_rank, qk_nope/qk_rope head dims, v_head_dim, interleaved rope),
`first_k_dense_replace` dense layers, shared experts, sigmoid routing with `e_score_correction_bias`,
group-limited top-k (`n_group`, `topk_group`), `routed_scaling_factor`. What this adds to mbridge:
- group-limited routing (mbridge builds the router without groups) and the refusals of `SigmoidRouted`;
- Megatron-Core 0.16's MLATransformerConfig field name for the pre-YaRN context (mbridge 0.15 uses the old one);
- YaRN rope: transformers 5 names the type `rope_type` inside rope_parameters, mbridge reads `type`;
- Megatron's local spec keeps q_a/kv_a layernorms as separate modules (TE fuses them into the up projections,
  which is what mbridge's names say), and its core attention on CPU gets MLA's distinct K and V head dims;
- refusals: rope_interleave false (Megatron's MLA always de-interleaves), attention_bias true (Megatron's
  MLA projections have no bias), rope types other than default and yarn.
"""
from __future__ import annotations

from typing import Any

from mega_async.bridge.family import SigmoidRouted, UnsupportedModelError, _config_file, _rope


class DeepseekV3(SigmoidRouted):
    model_types = ("deepseek_v3",)

    def check(self, hf: Any) -> None:
        super().check(hf)
        where = _config_file(hf)
        if getattr(hf, "rope_interleave", True) is False:
            raise UnsupportedModelError(f"deepseek_v3: rope_interleave=false is not supported (Megatron's MLA rotates "
                                        f"interleaved pairs, as DeepSeek's checkpoints do) ({where})")
        if getattr(hf, "attention_bias", False):
            raise UnsupportedModelError(f"deepseek_v3: attention_bias=true is not supported (Megatron's MLA "
                                        f"projections have no bias) ({where})")
        kind = _rope(hf).get("rope_type", _rope(hf).get("type", "default"))
        if kind not in ("default", "yarn"):
            raise UnsupportedModelError(f"deepseek_v3: rope type {kind!r} is not supported (default or yarn) ({where})")

    def mbridge(self, hf: Any, dtype: Any) -> Any:
        from mbridge.models.deepseek_v3 import DeepseekV3Bridge

        class Bridge(DeepseekV3Bridge):
            def _build_base_config(self, text_config_key: Any = None, **kw: Any) -> Any:
                # Megatron-Core 0.16 renamed MLATransformerConfig.max_position_embeddings (mbridge 0.15 passes it)
                if "max_position_embeddings" in kw:
                    kw["original_max_position_embeddings"] = kw.pop("max_position_embeddings")
                return super()._build_base_config(text_config_key, **kw)

        return Bridge(hf, dtype=dtype)

    def overrides(self, hf: Any, use_te: bool) -> dict[str, Any]:
        out = super().overrides(hf, use_te)
        rp = _rope(hf)
        if rp.get("rope_type", rp.get("type")) == "yarn":
            out.update(rope_type="yarn", rotary_scaling_factor=float(rp.get("factor", 1.0)),
                       mscale=float(rp.get("mscale", 1.0)), mscale_all_dim=float(rp.get("mscale_all_dim", 0.0)),
                       beta_fast=float(rp.get("beta_fast", 32)), beta_slow=float(rp.get("beta_slow", 1)),
                       original_max_position_embeddings=int(rp.get("original_max_position_embeddings", 4096)))
        else:
            # no scaling: transformers applies no mscale, and neither may Megatron (mbridge's defaults would)
            out.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=1.0)
        if not use_te:
            from megatron.core.transformer.enums import AttnBackend

            out["attention_backend"] = AttnBackend.local  # mbridge asks for TE's fused attention
        return out

    def layer_spec(self, spec: Any, use_te: bool) -> Any:
        """The local spec builds MLA's down projections (q_a_proj, kv_a_proj_with_mqa) column-parallel and
        gathers their outputs; the rope part of kv_a_proj_with_mqa is then replicated over TP and consumed by each
        rank's heads, but the gather's backward keeps only the owning rank's share of its gradient (measured: the
        TP2 step's kv_a_proj_with_mqa differed from one rank's by 1e-4). As Transformer Engine's spec does, they are
        replicated plain linears here ("duplicated", gradients summed over TP as sequence-parallel weights)."""
        if use_te:
            return spec
        from megatron.core.post_training.modelopt.layers import Linear
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        for layer in getattr(spec, "layer_specs", None) or [spec]:
            sub = layer.submodules.self_attention.submodules
            for f in ("linear_q_down_proj", "linear_kv_down_proj"):
                if getattr(sub, f, None) is ColumnParallelLinear:
                    setattr(sub, f, Linear)
        return spec

    def global_name(self, name: str, is_moe: bool) -> str:
        # MLA keeps input_layernorm apart (mbridge maps it as is); the local spec's q/kv layernorms are what TE
        # fuses into the up projections
        name = name.replace(".self_attention.q_layernorm.weight", ".self_attention.linear_q_up_proj.layer_norm_weight")
        return name.replace(".self_attention.kv_layernorm.weight", ".self_attention.linear_kv_up_proj.layer_norm_weight")
