"""Build Megatron-Core GPT models (MoE or dense) from HF configs at any parallel layout.

The bridge (`mega_async.bridge`) supplies the TransformerConfig and the HF names; this module sets the
run options on that config, picks the layer spec (Megatron's local modules on CPU, Transformer
Engine on GPU when installed) and builds one GPTModel per virtual pipeline chunk of this rank.
"""
from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from mega_async.bridge import mtp as mtp_plan
from mega_async.trainer.mcore_fixes import apply_mcore_fixes, mark_expert_gradients
from mega_async.trainer.parallel import as_strategy, init_parallel_state, validate_for_model

logger = logging.getLogger("mega_async.trainer")


def _configure(bridge: Any, recompute: Optional[dict] = None) -> None:
    """Run options on the bridge's TransformerConfig (CPU-safe fusions, per-token loss, p2p mode, `recompute`:
    trainer.recompute's Megatron fields)."""
    from megatron.core.distributed import finalize_model_grads

    from mega_async.trainer.cpu import patch_without_te

    if not bridge.use_te:
        patch_without_te()  # MLA's local spec
    mb = bridge.mb
    overrides: dict[str, Any] = dict(
        moe_grouped_gemm=bridge.use_te,  # local spec: SequentialMLP (one module per expert)
        persist_layer_norm=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=bridge.use_te,
        bias_dropout_fusion=bridge.use_te,
        gradient_accumulation_fusion=False,
        sequence_parallel=mb.mpu.tp_size > 1,  # Megatron requires it for MoE with TP
        use_cpu_initialization=bridge.on_cpu,
        batch_p2p_comm=False,  # batched p2p gave wrong VPP gradients on gloo
        deterministic_mode=False,
        # losses are token sums; Megatron divides the gradients by the global token count
        # (all-reduced over DP) instead of averaging per micro-batch and per DP rank
        calculate_per_token_loss=True,
    )
    overrides.update(bridge.family.overrides(bridge.hf_config, bridge.use_te))  # e.g. DeepSeek's router groups
    overrides.update(recompute or {})
    if mb.mpu.vpp_size is None or mb.mpu.pp_size == 1:
        overrides["overlap_p2p_comm"] = False
    mb.set_extra_args(**overrides)
    bridge.config = mb.config
    bridge.config.pipeline_model_parallel_size = mb.mpu.pp_size  # else every stage builds all layers
    # DP reduce-scatter, TP all-reduce of sequence-parallel norm/router grads, token-count scaling
    bridge.config.finalize_model_grads_func = finalize_model_grads


def _layer_spec(bridge: Any, vp_stage: Optional[int]) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from mega_async.trainer.attention import use_packed_attention

    cfg = bridge.config
    if bridge.is_moe:
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=bridge.use_te, normalization="RMSNorm",
                                          vp_stage=vp_stage)
        spec = bridge.family.layer_spec(spec, bridge.use_te)  # e.g. MLA's replicated down projections
    elif bridge.use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
    # local spec: packed 1-D micro-batches need THD attention (TE has it natively)
    return spec if bridge.use_te else use_packed_attention(spec)


def _build(bridge: Any) -> list[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage of this rank."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel

    from mega_async.trainer import mtp

    hf = bridge.hf_config
    vpp = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
    models = []
    for stage in range(vpp):
        vp = stage if vpp > 1 else None
        spec = _layer_spec(bridge, vp)
        mtp_spec = mtp.mtp_block_spec(bridge, spec, vp)  # MTP layers (num_nextn_predict_layers) on the last stage
        m = (mtp.model_class() if bridge.mtp_layers else GPTModel)(
            config=bridge.config,
            transformer_layer_spec=spec,
            mtp_block_spec=mtp_spec,
            vocab_size=hf.vocab_size,
            max_sequence_length=hf.max_position_embeddings,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=bool(getattr(hf, "tie_word_embeddings", False)),
            position_embedding_type="rope",
            rotary_base=hf.rope_theta,
            vp_stage=vp,
            **bridge.family.model_args(hf),  # e.g. GLM's partial rotary
        )
        m.to(bridge.dtype)
        if torch.cuda.is_available():
            m.cuda()
        m._mega_async_bridge = bridge
        models.append(m)
    return models


def _rank_memory() -> int:
    """What one rank's model may take: its GPU's memory (Megatron builds the weights there), else its share of the
    host's available memory (the node's ranks build at once)."""
    from mega_async.bridge.model_cards import available_memory

    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
        return torch.cuda.get_device_properties(local).total_memory
    return available_memory() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _mtp_layers(hf_config: Any, hf_dir: Any, mode: str) -> tuple[int, bool]:
    """(MTP layers to build, whether fresh) for trainer.mtp=`mode`; what the safetensors in `hf_dir` carry decide
    train and freeze (no weights there, e.g. a converted checkpoint's hf/ card: the card's count)."""
    asked = mtp_plan.mtp_layers(hf_config)
    if not asked:
        return 0, False
    held = set(range(asked))
    if isinstance(hf_dir, (str, os.PathLike)) and any(Path(hf_dir).glob("*.safetensors")):
        from mega_async.utils.safe_load import SafetensorsDir

        held = mtp_plan.held_layers(SafetensorsDir(hf_dir).names(), int(hf_config.num_hidden_layers))
    layers, fresh, warning = mtp_plan.plan(asked, held, mode, str(hf_dir))
    if warning and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("%s", warning)
    elif fresh and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.info("trainer.mtp=init: %d multi-token-prediction layer(s) start from Megatron's initialisation%s",
                    layers, " (the checkpoint's are not loaded)" if held else "")
    return layers, fresh


def build_model(hf_dir_or_config: Any, allocation: Any, dtype: torch.dtype = torch.float32,
                load_weights: bool = False, layer_spec: str = "auto", mtp: str = "train",
                recompute: Optional[dict] = None) -> list[torch.nn.Module]:
    """One module per virtual pipeline chunk of this rank.

    `allocation` is a string ("megatron:d1t2e2"), a parsed Allocation or a ParallelStrategy. Under
    torchrun this initialises torch.distributed and Megatron's parallel state when they are not yet;
    the layout is checked against the model first. With `load_weights` (an HF directory), its
    safetensors are loaded too. `layer_spec`: auto (Transformer Engine on GPU when installed, else
    Megatron's local modules), local, or te. `mtp` (trainer.mtp) decides the multi-token-prediction layers built
    from a card that asks for them (`mega_async.bridge.mtp.plan`: off builds none, init fresh ones, train and freeze
    the checkpoint's, or none with a warning when the checkpoint carries none, as transformers saves a model).
    `recompute`: Megatron's activation-recompute fields (`TrainerConfig.recompute_options()`).
    """
    from mega_async.bridge import HFBridge, _hf_config, load_hf_weights
    from mega_async.bridge.model_cards import check_fits_memory

    strategy = as_strategy(allocation)
    check_fits_memory(hf_dir_or_config, str(hf_dir_or_config) if isinstance(hf_dir_or_config, (str, os.PathLike))
                      else "the model config", dtype_bytes=dtype.itemsize, dense_shards=strategy.tp * strategy.pp,
                      expert_shards=strategy.ep * strategy.etp * strategy.pp, memory=_rank_memory(),
                      what=f"in {str(dtype)[6:]} on this rank")
    hf_config = copy.deepcopy(_hf_config(hf_dir_or_config))  # its MTP layer count is what the run builds
    asked = mtp_plan.mtp_layers(hf_config)
    layers, fresh = _mtp_layers(hf_config, hf_dir_or_config, mtp)
    if asked:
        hf_config.num_nextn_predict_layers = layers
    if layers and (recompute or {}).get("recompute_num_layers", 1) != 1:
        raise ValueError(f"trainer.recompute_num_layers={recompute['recompute_num_layers']}: Megatron-Core recomputes a "
                         f"multi-token-prediction layer alone, and this model trains {layers}; use 1, or "
                         "trainer.mtp=off")
    validate_for_model(strategy, hf_config)
    init_parallel_state(strategy)
    bridge = HFBridge(hf_config, dtype=dtype, layer_spec=layer_spec)
    bridge.fresh_mtp, bridge.mtp_asked = fresh, asked
    _configure(bridge, recompute)
    models = _build(bridge)
    apply_mcore_fixes()
    mark_expert_gradients(models)  # Megatron-LM#5916 on 0.16.1 (mega_async.trainer.mcore_fixes)
    if load_weights:
        if not isinstance(hf_dir_or_config, (str, os.PathLike)):
            raise ValueError("load_weights=True needs an HF directory, not an in-memory config")
        load_hf_weights(models, hf_dir_or_config)
    return models
