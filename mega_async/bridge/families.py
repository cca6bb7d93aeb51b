"""Per-family knowledge the bridge adds on top of mbridge: what a family's HF config may ask for (a one-line
refusal for what Megatron cannot do here), the HF config fields mbridge reads under their transformers-4
names, TransformerConfig overrides where mbridge's choice differs from the HF model, GPTModel arguments,
and Megatron local-spec parameter names -> mbridge's (Transformer Engine style) names.

Families: `Family` (Qwen2/Qwen3, dense and MoE: the defaults), `mega_async.bridge.deepseek_v3`
(DeepSeek-V3/R1, Kimi-K2) and `mega_async.bridge.glm4_moe` (GLM-4.5/4.6). `family_for(hf_config)` picks one.
Imports nothing heavy, so the CLI can check a model card before anything starts.
"""
from __future__ import annotations

from typing import Any

from mega_async.bridge.deepseek_v3 import DeepseekV3
from mega_async.bridge.family import Family, SigmoidRouted, UnsupportedModelError
from mega_async.bridge.glm4_moe import Glm4Moe

__all__ = ["DeepseekV3", "Family", "Glm4Moe", "SigmoidRouted", "UnsupportedModelError", "check_model", "family_for"]


def family_for(hf: Any) -> Family:
    for fam in (DeepseekV3(), Glm4Moe()):
        if getattr(hf, "model_type", None) in fam.model_types:
            return fam
    return Family()


def check_model(hf: Any) -> None:
    """One-line refusal (UnsupportedModelError) for an HF config the trainer cannot build faithfully."""
    family_for(hf).check(hf)
