"""Checkpoints as users bring them, for tests: a model card saved the way transformers saves it."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable, Union

import torch


def transformers_saved(card: Union[str, Path], out: Union[str, Path], seed: int = 0,
                       drop: Iterable[str] = ()) -> Path:
    """`card`'s model built by transformers from its config (seeded) and written with `save_pretrained`, its
    tokenizer files beside it: as a model fine-tuned with transformers reaches us. transformers has no module for
    DeepSeek-V3's and GLM-4.5's multi-token-prediction layers, so config.json keeps num_nextn_predict_layers: 1
    and the weights carry none of model.layers.{num_hidden_layers}.*. `drop`: tensor names (suffixes) left out
    too, for a checkpoint that lacks a group its config asks for."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from mega_async.bridge.model_cards import _random_router_bias

    card, out = Path(card), Path(out)
    cfg = AutoConfig.from_pretrained(card)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        _random_router_bias(model)
    model.save_pretrained(str(out))
    drop = tuple(drop)
    if drop:
        path = out / "model.safetensors"
        kept = {k: v for k, v in load_file(str(path)).items() if not k.endswith(drop)}
        save_file(kept, str(path), metadata={"format": "pt"})
    for f in card.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors") and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
    return out
