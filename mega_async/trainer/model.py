"""Build Megatron-Core GPT models (MoE or dense) from HF configs at any parallel layout."""
from __future__ import annotations

import os
from typing import Any

import torch

from mega_async.trainer.parallel import as_strategy, init_parallel_state, validate_for_model


def build_model(hf_dir_or_config: Any, allocation: Any, dtype: torch.dtype = torch.float32,
                load_weights: bool = False, layer_spec: str = "auto") -> list[torch.nn.Module]:
    """One module per virtual pipeline chunk of this rank.

    `allocation` is a string ("megatron:d1t2e2"), a parsed Allocation or a ParallelStrategy. Under
    torchrun this initialises torch.distributed and Megatron's parallel state when they are not yet;
    the layout is checked against the model first. With `load_weights` (an HF directory), its
    safetensors are loaded too. `layer_spec`: auto (Transformer Engine on GPU when installed, else
    Megatron's local modules), local, or te.
    """
    from mega_async.bridge import HFBridge, _hf_config, load_hf_weights

    strategy = as_strategy(allocation)
    hf_config = _hf_config(hf_dir_or_config)
    validate_for_model(strategy, hf_config)
    init_parallel_state(strategy)
    bridge = HFBridge(hf_config, dtype=dtype, layer_spec=layer_spec)
    models = bridge.build()
    for m in models:
        m._mega_async_bridge = bridge
    if load_weights:
        if not isinstance(hf_dir_or_config, (str, os.PathLike)):
            raise ValueError("load_weights=True needs an HF directory, not an in-memory config")
        load_hf_weights(models, hf_dir_or_config)
    return models
