"""FP8 block checkpoints (DeepSeek-V3's published format): e4m3 weights with one float32 `weight_scale_inv` per
block of the weight (`quantization_config.weight_block_size`, [128, 128] there; ragged blocks at the edges).

    w = fp8.to(float32) * scale_inv, broadcast over each block   (DeepSeek's fp8_cast_bf16, SGLang's
                                                                  block_quant_dequant)

The names are the checkpoint's: `<module>.weight` in float8_e4m3fn beside `<module>.weight_scale_inv`
[ceil(out / block_out), ceil(in / block_in)], what an SGLang server started on such a checkpoint loads (its
Fp8LinearMethod / Fp8MoEMethod parameters). Quantized: the linear layers of the decoder layers (the 2-D
`model.layers.<i>.*.weight`: attention incl. MLA's kv_a_proj_with_mqa, dense MLPs, shared and routed experts);
kept: embeddings, head, norms, the routers (`mlp.gate`) and their bias, and any module the config's
`modules_to_not_convert` / `ignored_layers` names.
Tensor functions, no I/O but a config.json read: the trainer's loader (mega_async.bridge), the resharder's exports
and the weight sync (mega_async.trainer) and the embedded server call them.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Iterator, Optional

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALE_SUFFIX = "_scale_inv"
_LAYER_WEIGHT = re.compile(r"^model\.layers\.\d+\..+\.weight$")
_KEPT = (".mlp.gate", ".embed_tokens", ".shared_head.head")  # the router; an MTP layer's embedding and head
SYNC_FORMATS = ("model_dtype", "fp8_block")


class Fp8FormatError(ValueError):
    """An FP8 block checkpoint or update that cannot be read as one (one line: which tensor and why)."""


def _quant_dict(hf_config: Any) -> dict:
    q = getattr(hf_config, "quantization_config", None) if not isinstance(hf_config, dict) else \
        hf_config.get("quantization_config")
    if q is None:
        return {}
    if not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else dict(vars(q))
    return q


def block_size(hf_config: Any) -> Optional[tuple[int, int]]:
    """(rows, cols) of an FP8 block checkpoint's config (an HF config or its dict), else None."""
    q = _quant_dict(hf_config)
    block = q.get("weight_block_size")
    if q.get("quant_method") != "fp8" or not block:
        return None
    if len(block) != 2 or min(int(b) for b in block) < 1:
        raise Fp8FormatError(f"quantization_config.weight_block_size={block!r} must be two sizes >= 1, e.g. [128, 128]")
    return int(block[0]), int(block[1])


def skipped_modules(hf_config: Any) -> tuple[str, ...]:
    q = _quant_dict(hf_config)
    return tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ())


def is_quantized(name: str, shape: tuple[int, ...], skip: tuple[str, ...] = ()) -> bool:
    """Whether checkpoint tensor `name` is stored in FP8 blocks (see the module docstring)."""
    if len(shape) != 2 or not _LAYER_WEIGHT.match(name):  # norms are 1-D
        return False
    module = name[: -len(".weight")]
    if module.endswith(_KEPT):
        return False
    return not any(module == s or module.startswith(s + ".") or f".{s}." in f".{module}." for s in skip)


def _scales(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    rows, cols = shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != want:
        raise Fp8FormatError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, a {rows}x{cols} weight in "
                             f"{block[0]}x{block[1]} blocks needs {want}")
    return scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference formula: fp8.to(float32) * scale_inv over each block, then `dtype`."""
    if weight.dtype != FP8 or weight.dim() != 2:
        raise Fp8FormatError(f"expected a 2-D float8_e4m3fn weight, got {weight.dtype} {tuple(weight.shape)}")
    return (weight.float() * _scales(scale_inv, tuple(weight.shape), block)).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block e4m3 quantization (DeepSeek's weight_quant): scale_inv = amax / 448 per block, fp8 = w / scale_inv
    (round to nearest). Returns (fp8 weight, float32 scale_inv)."""
    if weight.dim() != 2:
        raise Fp8FormatError(f"FP8 block quantization needs a 2-D weight, got {tuple(weight.shape)}")
    rows, cols = weight.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    w = weight.detach().float()
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w
    amax = padded.view(nr, br, nc, bc).abs().amax(dim=(1, 3))
    scale_inv = amax.clamp(min=1e-12) / FP8_MAX
    q = (w / _scales(scale_inv, (rows, cols), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale_inv


def quantize_named(named: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int],
                   skip: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors as an FP8 block checkpoint holds them: each quantized weight followed at once by its
    `<name>_scale_inv` (so one bucket holds both); everything else unchanged."""
    for name, t in named:
        if is_quantized(name, tuple(t.shape), skip):
            q, s = quantize(t, block)
            yield name, q
            yield name + SCALE_SUFFIX, s
        else:
            yield name, t


def dequantize_named(named: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int],
                     dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors with every FP8 weight and its scale_inv replaced by the dequantized weight (`dtype`), in
    any order (a checkpoint's files; a flattened bucket sorts its tensors by alignment). A weight or scale left
    without its other half at the end is an Fp8FormatError: the two travel in one update."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, t in named:
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base in weights:
                yield base, dequantize(weights.pop(base), t, block, dtype)
            else:
                scales[base] = t
        elif t.dtype == FP8:
            if name in scales:
                yield name, dequantize(t, scales.pop(name), block, dtype)
            else:
                weights[name] = t
        else:
            yield name, t
    if scales or weights:
        name, what = ((next(iter(scales)) + SCALE_SUFFIX, "the FP8 weight it scales") if scales else
                      (next(iter(weights)), "its weight_scale_inv"))
        raise Fp8FormatError(f"{name} came without {what} (an FP8 weight and its scale travel in one update)")


def sync_block(weight_format: str, hf_config: Any) -> Optional[tuple[int, int]]:
    """The block the weight sync quantizes to (None: send the trainer's own dtype). fp8_block needs the servers'
    checkpoint (model.path) to be an FP8 block one: a server loads updates in the format it was started on."""
    if weight_format not in SYNC_FORMATS:
        raise ValueError(f"trainer.sync_weight_format={weight_format!r}: use {' or '.join(SYNC_FORMATS)}")
    if weight_format == "model_dtype":
        return None
    block = block_size(hf_config)
    if block is None:
        raise ValueError("trainer.sync_weight_format=fp8_block needs model.path to be an FP8 block checkpoint "
                         "(config.json quantization_config: quant_method fp8, weight_block_size): servers started on "
                         "it load FP8 weights and their weight_scale_inv; use sync_weight_format=model_dtype")
    return block


def dir_block(d: Any) -> Optional[tuple[int, int]]:
    """The FP8 block of the checkpoint directory `d` (its config.json), else None."""
    import json
    from pathlib import Path

    f = Path(d) / "config.json"
    return block_size(json.loads(f.read_text())) if f.is_file() else None


def dequantize_stored(name: str, t: torch.Tensor, scale_of: Any, block: Optional[tuple[int, int]],
                      where: Any) -> torch.Tensor:
    """A tensor read from checkpoint `where`: an FP8 weight comes back dequantized (float32) with its
    `<name>_scale_inv` (`scale_of(name)`), anything else as stored."""
    if t.dtype != FP8:
        return t
    if block is None:
        raise Fp8FormatError(f"{where}: {name} is float8_e4m3fn but config.json has no FP8 block quantization_config "
                             "(quant_method fp8, weight_block_size)")
    try:
        scale = scale_of(name + SCALE_SUFFIX)
    except KeyError:
        raise Fp8FormatError(f"{where}: {name} is float8_e4m3fn without {name}{SCALE_SUFFIX}") from None
    return dequantize(t, scale, block)


def config_for(config: dict, block: Optional[tuple[int, int]]) -> dict:
    """config.json for weights written in `block` FP8 blocks (None: in a plain dtype): an FP8 checkpoint's
    quantization_config is dropped from a plain export (transformers would read the bf16 weights as FP8), and an
    FP8 export says its block."""
    out = dict(config)
    q = dict(out.get("quantization_config") or {})
    if block is None:
        if q.get("quant_method") == "fp8":
            out.pop("quantization_config", None)
        return out
    q.update(quant_method="fp8", fmt="e4m3", activation_scheme=q.get("activation_scheme", "dynamic"),
             weight_block_size=[int(block[0]), int(block[1])])
    out["quantization_config"] = q
    return out


def write_checkpoint(src: Any, dst: Any, block: tuple[int, int]) -> Any:
    """An FP8 block copy of the HF checkpoint `src` at `dst` (DeepSeek-V3's published layout: quantized weights,
    their weight_scale_inv, config.json with the quantization_config; tokenizer files copied). For tests and
    for serving a bf16 card in FP8."""
    import json
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import save_file

    from mega_async.bridge.model_cards import copy_model_files

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    skip = skipped_modules(config)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update(quantize_named(((k, sf.get_tensor(k)) for k in sf.keys()), block, skip))
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    copy_model_files(src, dst, skip=("config.json",))
    (dst / "config.json").write_text(json.dumps(config_for(config, block), indent=2) + "\n")
    return dst
