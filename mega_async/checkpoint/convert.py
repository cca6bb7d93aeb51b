"""Checkpoint conversion: HF safetensors <-> Megatron distributed checkpoint, at any TP/PP/EP layout.

    hf-to-mcore: HF dir -> build at the layout -> load HF weights -> dist_checkpointing.save
    mcore-to-hf: mcore dir -> build at a layout -> dist_checkpointing.load -> gathered HF export

Run in one process or under torchrun (the layout's world size). Writes go to `<out>.partial.<random>` (this
conversion's own) and are renamed at the end, so an interrupted conversion never leaves a half checkpoint and two
conversions to one output each finish whole.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

from mega_async.checkpoint.format import check_dist_checkpoint, model_sharded_state_dict
from mega_async.bridge.model_cards import DTYPES, copy_model_files, set_config_dtype, set_config_mtp, source_dtype
from mega_async.utils.outputs import check_replaceable

logger = logging.getLogger("mega_async.checkpoint.convert")

META = "mega_async_meta.json"
HF_SUBDIR = "hf"  # config and tokenizer files of the source model, kept with the Megatron checkpoint


class ConvertError(RuntimeError):
    pass


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def model_tensor_names(names: list[str], models: Any) -> list[str]:
    """The checkpoint's tensors the model has: DeepSeek-V3 and GLM-4.5 checkpoints append their MTP layers as
    model.layers.{num_hidden_layers + k}.* (loaded and exported for the config's num_nextn_predict_layers; a config
    with fewer, e.g. 0, neither loads nor exports the others)."""
    import re

    from mega_async.bridge import bridge_for

    bridge = bridge_for(models)
    layers = int(bridge.hf_config.num_hidden_layers) + bridge.mtp_layers
    beyond = re.compile(r"^model\.layers\.(\d+)\.")
    # an FP8 block checkpoint's weight_scale_inv is part of its weight (loaded dequantized, exported in the dtype)
    return [n for n in names if not ((m := beyond.match(n)) and int(m[1]) >= layers) and not n.endswith("_scale_inv")]


def hf_to_mcore(hf_dir: str, out_dir: str, allocation: str, dtype: Optional[str] = None) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    from mega_async.bridge import HFTensors, bridge_for, load_hf_weights
    from mega_async.utils.lifeline import guard_checkpoint_writer
    from mega_async.trainer.model import build_model

    src, out = Path(hf_dir), Path(out_dir)
    check_replaceable(out, "mcore")  # before any work: a mistyped --out is refused, and nothing in it is touched
    if not (src / "config.json").exists():
        raise ConvertError(f"{src} is not an HF model directory (no config.json)")
    if not list(src.glob("*.safetensors")):
        raise ConvertError(f"{src} has no *.safetensors weights")
    t0 = time.monotonic()
    import torch

    dtype = dtype or source_dtype(src)
    models = build_model(src, allocation, dtype=getattr(torch, dtype))
    n = load_hf_weights(models, src, progress=True)
    from mega_async.trainer.weights import partial_dir, swap_in

    tmp = partial_dir(out, "mcore")  # this conversion's own: a second one writing the same output never shares it
    try:
        logger.info("loaded %d local tensors from %s; saving Megatron checkpoint", n, src)
        guard_checkpoint_writer()  # Megatron's writer process ends with this one, even under kill -9
        dist_checkpointing.save(model_sharded_state_dict(models), str(tmp))
        nbytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        count = len(model_tensor_names(HFTensors(src).names(), models))
        if _rank() == 0:
            copy_model_files(src, tmp / HF_SUBDIR)
            set_config_dtype(tmp / HF_SUBDIR, dtype)
            set_config_mtp(tmp / HF_SUBDIR, bridge_for(models).mtp_layers)  # what was converted
            (tmp / META).write_text(json.dumps({"format": "megatron-dist-ckpt", "allocation": allocation,
                                                "source": str(src.resolve()), "hf_tensors": count, "dtype": dtype},
                                               indent=2))
            swap_in(tmp, out, "mcore")
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    return {"tensors": count, "bytes": nbytes, "seconds": time.monotonic() - t0}


def mcore_to_hf(mcore_dir: str, out_dir: str, allocation: Optional[str] = None,
                dtype: Optional[str] = None) -> dict[str, Any]:
    """The checkpoint is untrusted: no link or special file in it, its pickled parts read with checkpoint
    classes only, its objects and torch files tensors-only, NaN/inf weights refused (mega_async.utils.safe_load)."""
    from mega_async.trainer.weights import save_hf_checkpoint
    from mega_async.checkpoint.check import check_run_dir, read_json
    from mega_async.utils.safe_load import dist_load
    from mega_async.trainer.model import build_model

    src = Path(mcore_dir)
    check_replaceable(Path(out_dir), "hf")  # before any work: a mistyped --out is refused, nothing in it touched
    meta_path = src / META
    if not meta_path.exists():
        raise ConvertError(f"{src} is not a checkpoint written by hf-to-mcore (no {META})")
    check_run_dir(src)  # the hf/ files are copied into the output: none may point elsewhere
    meta = read_json(meta_path, "conversion record", "convert again with hf-to-mcore")
    if not isinstance(meta, dict):
        raise ConvertError(f"{meta_path}: not a conversion record (an object)")
    allocation = allocation or "megatron:d1"
    check_dist_checkpoint(src)  # its pickled parts could run code: refuse anything but checkpoint classes
    t0 = time.monotonic()
    import torch

    saved = meta.get("dtype") if meta.get("dtype") in DTYPES else source_dtype(src / HF_SUBDIR)
    dtype = dtype or saved
    models = build_model(src / HF_SUBDIR, allocation, dtype=getattr(torch, saved))  # loaded as it was saved
    state = dist_load(model_sharded_state_dict(models), src)
    keys = ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]
    for k, m in zip(keys, models):
        m.load_state_dict(state[k], strict=False)
        m.to(getattr(torch, dtype))
    stats = save_hf_checkpoint(models, out_dir, src_dir=src / HF_SUBDIR, progress=True, dtype_name=dtype)
    if stats["tensors"] and meta.get("hf_tensors") and stats["tensors"] != meta["hf_tensors"] and _rank() == 0:
        raise ConvertError(f"exported {stats['tensors']} tensors, the source had {meta['hf_tensors']}")
    return {**stats, "seconds": time.monotonic() - t0}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="mega-async convert", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron distributed checkpoint")
    a.add_argument("--hf", required=True, help="HF model directory")
    a.add_argument("--out", required=True)
    a.add_argument("--allocation", default="megatron:d1", help="trainer layout, e.g. megatron:t2 or megatron:d2t2e2")
    a.add_argument("--dtype", choices=DTYPES, default=None, help="the checkpoint's dtype (default: the source's)")
    b = sub.add_parser("mcore-to-hf", help="Megatron distributed checkpoint -> HF safetensors (+ config, tokenizer)")
    b.add_argument("--mcore", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--allocation", default=None, help="layout to load at (default: one rank)")
    b.add_argument("--dtype", choices=DTYPES, default=None,
                   help="the HF weights' dtype, written to config.json too (default: the checkpoint's)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from mega_async.checkpoint.format import CheckpointError
    from mega_async.trainer.parallel import AllocationError

    try:
        if args.direction == "hf-to-mcore":
            stats = hf_to_mcore(args.hf, args.out, args.allocation, args.dtype)
        else:
            stats = mcore_to_hf(args.mcore, args.out, args.allocation, args.dtype)
    except (ConvertError, CheckpointError, AllocationError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"convert: {e}", file=sys.stderr)
        return 2
    from mega_async.trainer.parallel import destroy_parallel_state

    destroy_parallel_state()  # every rank got here: leave together
    if _rank() == 0:
        print(f"converted {args.direction}: {stats['tensors']} tensors, {stats['bytes'] / 2**20:.1f} MiB, "
              f"{stats['seconds']:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
