"""Model cards under models/: HF configs + tokenizers; random-init weights made locally, never downloaded."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("mega_async.model_cards")

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_MOE = REPO_ROOT / "models" / "tiny-qwen3-moe"
TINY_DENSE = REPO_ROOT / "models" / "tiny-qwen3"
# DeepSeek-V3 architecture: MLA, a dense first layer, shared experts, sigmoid + bias group-limited routing
TINY_DEEPSEEK = REPO_ROOT / "models" / "tiny-deepseek-v3"
# GLM-4.5 (Glm4MoeForCausalLM): shared experts, sigmoid + bias routing, partial rotary, qkv bias
TINY_GLM = REPO_ROOT / "models" / "tiny-glm4-moe"
MOE_CARDS = {"qwen3_moe": TINY_MOE, "deepseek_v3": TINY_DEEPSEEK, "glm4_moe": TINY_GLM}


def has_weights(model_dir: str | os.PathLike) -> bool:
    d = Path(model_dir)
    return (d / "model.safetensors").exists() or (d / "model.safetensors.index.json").exists()


def copy_model_files(src: str | os.PathLike, dst: str | os.PathLike, skip: tuple[str, ...] = ()) -> None:
    """An HF directory's files other than its weights (config, tokenizer, chat template, generation config) into
    `dst`: what every writer of an HF directory copies (the export, the converter, the FP8 quantizer). Names in
    `skip` are left out too (a writer that rewrites them)."""
    import shutil

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json" \
                and f.name not in skip:
            shutil.copy2(f, dst / f.name)


def ensure_weights(model_dir: str | os.PathLike, seed: int = 0) -> bool:
    """A card with a config but no weights gets its deterministic random init (seed) in place, once; returns
    whether it was written now. Every driver and launcher calls this one (the tiny CPU cards ship configs only)."""
    if has_weights(model_dir):
        return False
    logger.info("%s has no weights yet: writing a deterministic random init (seed %d)", model_dir, seed)
    init_random_weights(model_dir, seed=seed)
    return True


def init_random_weights(model_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None, seed: int = 0,
                        force: bool = False) -> Path:
    """Write deterministic random-init safetensors for the config in `model_dir` (to `out_dir` or in place).

    Same seed, same torch version -> the same bytes. Existing weights are kept unless `force`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = Path(model_dir)
    dst = Path(out_dir) if out_dir is not None else src
    if has_weights(dst) and not force:
        return dst
    if not (src / "config.json").exists():
        raise FileNotFoundError(f"{src}/config.json not found: a model card directory needs an HF config")
    cfg = AutoConfig.from_pretrained(src)
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        _random_router_bias(model)
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / ".model.safetensors.tmp"
    model.save_pretrained(str(dst / ".tmp_save"))
    os.replace(dst / ".tmp_save" / "model.safetensors", tmp)
    for f in (dst / ".tmp_save").iterdir():
        f.unlink()
    (dst / ".tmp_save").rmdir()
    os.replace(tmp, dst / "model.safetensors")
    if dst != src:
        import shutil

        for f in src.iterdir():
            if f.is_file() and f.name != "model.safetensors" and not (dst / f.name).exists():
                shutil.copy2(f, dst / f.name)
        AutoTokenizer.from_pretrained(src)  # fail early when the card's tokenizer is broken
    logger.info("wrote random-init weights (seed %d, %d params) to %s", seed,
                sum(p.numel() for p in model.parameters()), dst)
    return dst


def _random_router_bias(model: torch.nn.Module, std: float = 0.02) -> None:
    """transformers initialises sigmoid routers' `e_score_correction_bias` to zeros; a trained DeepSeek-V3 or
    GLM-4.5 has a bias that changes which experts are picked (not their weights). A random one, of the size
    of the sigmoid scores' spread, makes the tiny cards exercise that path."""
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, std)


def derive_card(base: str | os.PathLike, out_dir: str | os.PathLike, seed: int = 0, **config: Any) -> Path:
    """A model card like `base` with some config fields changed (e.g. num_hidden_layers=3), its tokenizer
    files copied and deterministic random weights written; returns `out_dir`."""
    from transformers import AutoConfig

    base, out = Path(base), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.from_pretrained(base)
    for k, v in config.items():
        setattr(cfg, k, v)
    cfg.save_pretrained(out)
    for f in base.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            (out / f.name).write_bytes(f.read_bytes())
    init_random_weights(out, seed=seed)
    return out
