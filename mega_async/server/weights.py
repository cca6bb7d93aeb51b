"""Load HF-checkpoint-named tensors into a live `transformers` model, validated and all-or-nothing.

Checkpoints (and the trainer's resharder) name MoE experts one by one
(`mlp.experts.{e}.gate_proj.weight`); transformers 5 keeps them fused in memory
(`mlp.experts.gate_up_proj[e]` = [gate; up], `mlp.experts.down_proj[e]`). This module maps between them.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from mega_async.utils.safe_load import SafetensorsDir

logger = logging.getLogger("mega_async.server")

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


def check_target(params: dict[str, torch.Tensor], name: str, shape: tuple[int, ...],
                 dtype: torch.dtype) -> torch.Tensor:
    """The live tensor `name` fills, after checking that a tensor of `shape` and `dtype` may fill it."""
    dst = _target(params, name)
    if tuple(dst.shape) != tuple(shape):
        raise WeightLoadError(f"weight {name!r} has shape {tuple(shape)}, the model expects {tuple(dst.shape)}")
    if not (dtype.is_floating_point or dtype == dst.dtype):
        raise WeightLoadError(f"weight {name!r} has dtype {dtype}, the model expects {dst.dtype}")
    return dst


def check_layout(model: torch.nn.Module, specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
    """Raise WeightLoadError unless every (name, shape, dtype) can be loaded into `model` (no data needed)."""
    params = dict(model.state_dict(keep_vars=False))
    for name, shape, dtype in _without_unheld_mtp(model, specs):
        check_target(params, name, shape, dtype)


class WeightBackup:
    """Copy-on-write CPU copies of weights, taken the first time each is overwritten; restored all at once.

    The embedded server keeps one across a pause window so that a failed bucket rolls back every earlier
    bucket of that window too.
    """

    def __init__(self) -> None:
        self._saved: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._saved)

    def save(self, name: str, dst: torch.Tensor) -> None:
        if name not in self._saved:
            self._saved[name] = (dst, dst.detach().to("cpu", copy=True))

    def restore(self) -> int:
        """Write every saved value back (newest first, so overlapping views end at their oldest value)."""
        n = len(self._saved)
        with torch.no_grad():
            for dst, old in reversed(list(self._saved.values())):
                dst.copy_(old)
        self._saved.clear()
        return n


def mtp_layers_held(model: torch.nn.Module) -> int:
    """How many multi-token-prediction layers the served model keeps (appended after its own layers)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    own = int(getattr(getattr(model, "config", None), "num_hidden_layers", 0) or 0)
    return max(0, len(layers) - own) if layers is not None and own else 0


def _layer(name: str) -> int:
    """The decoder layer a checkpoint name belongs to (-1: none)."""
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return int(m[1]) if m else -1


def _without_unheld_mtp(model: torch.nn.Module, items: Iterable[tuple]) -> list[tuple]:
    """(name, ...) items without the MTP layers' tensors when the config asks for MTP layers the server does not
    keep (a checkpoint saved without them): as SGLang's target model, whose load_weights skips those layers."""
    items = list(items)
    cfg = getattr(model, "config", None)
    if not int(getattr(cfg, "num_nextn_predict_layers", 0) or 0) or mtp_layers_held(model):
        return items
    layers = int(cfg.num_hidden_layers)
    return [it for it in items if _layer(it[0]) < layers]


def load_named_tensors(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]], strict: bool = False,
                       backup: Optional[WeightBackup] = None) -> int:
    """Copy tensors into the model by checkpoint name. Validates everything first; restores on failure.

    `strict` requires every model weight to be present (a full checkpoint). With `backup`, the old value of
    each overwritten weight is saved there first (once per weight) and a failure restores the whole backup.
    Returns tensors loaded.
    """
    params = dict(model.state_dict(keep_vars=False))
    named = _without_unheld_mtp(model, named)
    targets = [(name, check_target(params, name, tuple(t.shape), t.dtype), t) for name, t in named]
    if strict:
        have = {n for n, _, _ in targets}
        missing = [n for n, _ in checkpoint_names(model) if n not in have]
        tied = getattr(model.config, "tie_word_embeddings", False)
        missing = [n for n in missing if not (tied and n == "lm_head.weight")]
        own = int(getattr(model.config, "num_hidden_layers", 0) or 0)
        if mtp_layers_held(model) and not any(_layer(n) >= own for n in have):
            # a full checkpoint of the target alone (a run with trainer.mtp=off, or one that trained without the
            # layers): the draft's weights stay as they are, as a target-only reload leaves them
            missing = [n for n in missing if _layer(n) < own]
        if missing:
            raise WeightLoadError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[0]!r}")
    undo = backup if backup is not None else WeightBackup()
    try:
        with torch.no_grad():
            for name, dst, t in targets:
                undo.save(name, dst)
                dst.copy_(t.to(dst.dtype))
    except BaseException:
        undo.restore()
        raise
    return len(targets)


def read_safetensors_dir(path: str | Path, root: Optional[str | Path] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """All tensors of the *.safetensors files in an HF model directory (`safe_load.SafetensorsDir`: each file a
    regular file inside `root`; any refusal or unreadable file is a WeightLoadError naming the file)."""
    return SafetensorsDir(path, root, error=WeightLoadError).items()


def load_pretrained(path: str | Path, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    """transformers' model of an HF directory. An FP8 block checkpoint (DeepSeek-V3's format) is built from its
    config in `dtype` and loaded dequantized on the CPU (transformers' own FP8 path needs a GPU); its block is
    then the model's `fp8_block`, what later updates must be in too (`updates_dequantized`). A card asking for more
    memory than the host has (the model is built there first) is refused before anything is allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from mega_async.bridge import fp8
    from mega_async.bridge.model_cards import append_mtp_layers, check_fits_memory

    check_fits_memory(path, f"--model {path}", dtype_bytes=dtype.itemsize, what=f"in {str(dtype)[6:]}")

    block = fp8.dir_block(path)
    if block is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)  # no pickle
        prefixes = append_mtp_layers(model.config, model)
        if prefixes:  # the MTP layers (a draft's weights) are kept by their checkpoint names, not run
            tensors = SafetensorsDir(path, error=WeightLoadError)
            have = set(tensors.names())
            if not any(n.startswith(tuple(prefixes)) for n in have):
                # as transformers saves a model: served as the target model alone, as SGLang serves it
                del model.model.layers[int(model.config.num_hidden_layers):]
                logger.warning("%s: config.json asks for %d multi-token-prediction layer(s) but the checkpoint "
                               "carries none of their weights (as transformers saves a model): served without "
                               "them (no draft can be made of them)", path, len(prefixes))
                return model.to(device)
            missing = [n for n, _ in checkpoint_names(model) if n.startswith(tuple(prefixes)) and n not in have]
            if missing:
                raise WeightLoadError(f"{path}: num_nextn_predict_layers asks for MTP layers but the checkpoint lacks "
                                      f"{len(missing)} of their weights, e.g. {missing[0]!r} (set it to 0 in "
                                      "config.json)")
            load_named_tensors(model, ((n, tensors.get(n)) for n in sorted(have) if n.startswith(tuple(prefixes))))
        return model.to(device)
    cfg = AutoConfig.from_pretrained(path)
    del cfg.quantization_config  # the weights are dequantized here: a plain model
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    append_mtp_layers(cfg, model)
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass
    tensors = read_safetensors_dir(path)
    load_named_tensors(model, fp8.dequantize_named(tensors, block), strict=True)
    model.fp8_block = block
    return model.to(device)


def updates_dequantized(model: torch.nn.Module,
                        named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """An update's tensors for the live model: on a server started on an FP8 block checkpoint, each FP8 weight and
    its weight_scale_inv become the dequantized weight (SGLang's FP8 server loads both); elsewhere an FP8 weight
    is refused (its values mean nothing without the scale the model has no place for)."""
    from mega_async.bridge import fp8

    block = getattr(model, "fp8_block", None)
    if block is not None:
        return fp8.dequantize_named(named, block)
    named = list(named)
    for name, t in named:
        if t.dtype == fp8.FP8:
            raise WeightLoadError(f"weight {name!r} is float8_e4m3fn but this server was not started on an FP8 "
                                  "block checkpoint (start it on one, or send the trainer's dtype: "
                                  "trainer.sync_weight_format=model_dtype)")
    return named
