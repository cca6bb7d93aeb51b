"""Load HF-checkpoint-named tensors into a live `transformers` model, validated and all-or-nothing.

Checkpoints (and the trainer's resharder) name MoE experts one by one
(`mlp.experts.{e}.gate_proj.weight`); transformers 5 keeps them fused in memory
(`mlp.experts.gate_up_proj[e]` = [gate; up], `mlp.experts.down_proj[e]`). This module maps between them.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class WeightLoadError(ValueError):
    pass


def _target(params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The live tensor (or view of a fused tensor) that checkpoint name `name` fills."""
    if name in params:
        return params[name]
    m = _EXPERT.match(name)
    if m is not None:
        prefix, e, proj = m["prefix"], int(m["e"]), m["proj"]
        if proj == "down_proj" and f"{prefix}.down_proj" in params:
            fused = params[f"{prefix}.down_proj"]
            if e < fused.shape[0]:
                return fused[e]
        elif f"{prefix}.gate_up_proj" in params:
            fused = params[f"{prefix}.gate_up_proj"]
            if e < fused.shape[0]:
                half = fused.shape[1] // 2
                return fused[e, :half] if proj == "gate_proj" else fused[e, half:]
    raise WeightLoadError(f"weight {name!r} does not exist in this model")


def checkpoint_names(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor view) for every weight, experts split one by one."""
    for name, t in model.state_dict().items():
        if name.endswith(".experts.gate_up_proj"):
            prefix, half = name[: -len(".gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}.{e}.gate_proj.weight", t[e, :half]
                yield f"{prefix}.{e}.up_proj.weight", t[e, half:]
        elif name.endswith(".experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", t[e]
        else:
            yield name, t


def load_named_tensors(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]], strict: bool = False) -> int:
    """Copy tensors into the model by checkpoint name. Validates everything first; restores on failure.

    `strict` requires every model weight to be present (a full checkpoint). Returns tensors loaded.
    """
    params = dict(model.state_dict(keep_vars=False))
    targets = []
    for name, t in named:
        dst = _target(params, name)
        if tuple(dst.shape) != tuple(t.shape):
            raise WeightLoadError(f"weight {name!r} has shape {tuple(t.shape)}, the model expects {tuple(dst.shape)}")
        if not (t.dtype.is_floating_point or t.dtype == dst.dtype):
            raise WeightLoadError(f"weight {name!r} has dtype {t.dtype}, the model expects {dst.dtype}")
        targets.append((name, dst, t))
    if strict:
        have = {n for n, _, _ in targets}
        missing = [n for n, _ in checkpoint_names(model) if n not in have]
        tied = getattr(model.config, "tie_word_embeddings", False)
        missing = [n for n in missing if not (tied and n == "lm_head.weight")]
        if missing:
            raise WeightLoadError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[0]!r}")
    backup = [(dst, dst.detach().clone()) for _, dst, _ in targets]
    try:
        with torch.no_grad():
            for _, dst, t in targets:
                dst.copy_(t.to(dst.dtype))
    except BaseException:
        with torch.no_grad():
            for dst, old in backup:
                dst.copy_(old)
        raise
    return len(targets)


def read_safetensors_dir(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """All tensors of the *.safetensors files in an HF model directory."""
    d = Path(path)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {d}")
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                yield k, sf.get_tensor(k)
