"""HF <-> Megatron-Core names: the TransformerConfig and name tables for a model family, and loading HF
safetensors into any TP/PP/EP/ETP layout (each rank keeps its shard).

mbridge supplies the per-family knowledge (TransformerConfig from the HF config, HF <-> Megatron
name tables, qkv and gate/up packing) behind this small interface, so it can be replaced. Models
are built by `mega_async.trainer.model`; full tensors are gathered back by the resharder
(`mega_async.trainer.weights`: `export_hf_weights`, `save_hf_checkpoint`); this package imports nothing from the
trainer.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from mega_async.bridge import fp8, mtp
from mega_async.utils.safe_load import SafetensorsDir

logger = logging.getLogger("mega_async.bridge")

_MAIN = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "output_layer.weight": "lm_head.weight"}
_EXPERT_LOCAL = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_EXPERT_TE = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def _hf_config(hf_dir_or_config: Any) -> Any:
    from transformers import AutoConfig

    if isinstance(hf_dir_or_config, (str, os.PathLike)):
        d = Path(hf_dir_or_config)
        if not (d / "config.json").exists():
            raise FileNotFoundError(f"{d}/config.json not found: pass an HF model directory or config")
        return AutoConfig.from_pretrained(d)
    return hf_dir_or_config


class HFBridge:
    """One model family's HF <-> Megatron mapping for the current parallel layout (Megatron initialised)."""

    def __init__(self, hf_dir_or_config: Any, dtype: torch.dtype = torch.float32, layer_spec: str = "auto"):
        if layer_spec not in ("auto", "local", "te"):
            raise ValueError(f"layer_spec={layer_spec!r}: use auto, local or te")
        from mega_async.bridge.families import family_for

        hf = _hf_config(hf_dir_or_config)
        self.family = family_for(hf)
        self.family.check(hf)
        self.hf_config = self.family.prepare(hf)
        self.dtype = dtype
        self.on_cpu = not torch.cuda.is_available()
        if layer_spec == "te" and not self._te_available():
            raise RuntimeError("layer_spec=te needs CUDA and transformer-engine (pip install -e .[gpu])")
        self.use_te = self._te_available() if layer_spec == "auto" else layer_spec == "te"
        self.mb = self.family.mbridge(self.hf_config, dtype)
        self.num_layers = int(self.hf_config.num_hidden_layers)
        self.mtp_layers = mtp.mtp_layers(self.hf_config)  # multi-token-prediction layers (mega_async.bridge.mtp)
        self.fresh_mtp = False  # trainer.mtp=init: they are not loaded (`mega_async.trainer.model.build_model`)
        self.mtp_asked = self.mtp_layers  # what the card asked for (build_model sets it when it builds fewer)
        self.config = self.mb.config  # Megatron's TransformerConfig (trainer.model sets its run options)

    @staticmethod
    def _te_available() -> bool:
        if not torch.cuda.is_available():
            return False
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            return False
        return True

    @property
    def is_moe(self) -> bool:
        return bool(getattr(self.config, "num_moe_experts", None))

    # ---- names ---------------------------------------------------------------------------------
    def global_name(self, model: torch.nn.Module, local: str) -> str:
        """Local parameter name -> mbridge's (Transformer Engine style) global name."""
        from megatron.core import parallel_state as mpu

        name = local
        m = re.match(r"decoder\.layers\.(\d+)\.", name)
        if m:
            layer = _unwrap(model).decoder.layers[int(m[1])].layer_number - 1
            name = f"decoder.layers.{layer}." + name[m.end():]
        name = mtp.global_name(name, self.num_layers)  # an MTP layer's decoder block: HF layer num_layers + k
        name = self.family.global_name(name, self.is_moe)
        e = _EXPERT_LOCAL.search(name)
        if e:
            per_rank = self.config.num_moe_experts // mpu.get_expert_model_parallel_world_size()
            expert = int(e[1]) + per_rank * mpu.get_expert_model_parallel_rank()
            name = name[: e.start()] + f".mlp.experts.{e[2]}.weight{expert}"
        else:
            e = _EXPERT_TE.search(name)  # TE grouped experts: local index -> global
            if e:
                per_rank = self.config.num_moe_experts // mpu.get_expert_model_parallel_world_size()
                expert = int(e[2]) + per_rank * mpu.get_expert_model_parallel_rank()
                name = name[: e.start()] + f".mlp.experts.{e[1]}.weight{expert}"
        return name

    def hf_names(self, global_name: str) -> list[str]:
        return mtp.hf_names(global_name, self.num_layers) or self.mb._weight_name_mapping_mcore_to_hf(global_name)

    def to_hf(self, global_name: str, full: torch.Tensor) -> tuple[list[str], list[torch.Tensor]]:
        """A full Megatron tensor -> HF names and tensors (mbridge's split of fused tensors). The embedding and head
        map to their main names only (mbridge's DeepSeek table would add a 61-layer model's MTP copies itself:
        `export_names` adds them at any depth)."""
        own = mtp.hf_names(global_name, self.num_layers)
        if own:
            return own, [full]
        if global_name in _MAIN:
            return [_MAIN[global_name]], [full]
        return self.mb._weight_to_hf_format(global_name, full)

    def export_names(self, hf_name: str, model: torch.nn.Module) -> list[str]:
        """The HF names a tensor of this model chunk is exported under (the embedding and head also as the MTP
        layers' copies where the chunk holds the MTP layers)."""
        m = _unwrap(model)
        # the main embedding lives on the first stage (the last one holds a copy for its MTP layers), the head on the last
        main = getattr(m, "post_process" if hf_name == "lm_head.weight" else "pre_process", True)
        return mtp.export_names(hf_name, self.num_layers, self.mtp_layers, bool(main),
                                bool(getattr(m, "mtp_process", False)))

    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", False))

    # ---- load ----------------------------------------------------------------------------------
    def load(self, models: Sequence[torch.nn.Module], hf_dir: str | os.PathLike, progress: bool = False) -> int:
        """Every rank reads the HF tensors it needs and keeps its own TP/ETP shard. Returns tensors set."""
        from megatron.core import parallel_state as mpu

        reader = HFTensors(hf_dir)
        tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        etp, etp_rank = mpu.get_expert_tensor_parallel_world_size(), mpu.get_expert_tensor_parallel_rank()
        n = 0
        show = progress and (not dist.is_initialized() or dist.get_rank() == 0)
        for model in models:
            sd = _unwrap(model).state_dict()
            items = sd.items()
            if show:
                from tqdm import tqdm

                items = tqdm(list(items), desc="load HF tensors", unit="tensor")
            for local, param in items:
                if "_extra_state" in local or param is None:
                    continue
                g = self.global_name(model, local)
                names = self.hf_names(g)
                if names == ["lm_head.weight"] and self.tied() and "lm_head.weight" not in reader:
                    names = ["model.embed_tokens.weight"]
                if self.fresh_mtp and local.startswith("mtp."):
                    continue  # trainer.mtp=init: the MTP layers keep Megatron's initialisation
                missing = [x for x in names if x not in reader]
                if missing:
                    raise CheckpointMismatch(f"{hf_dir}: the checkpoint lacks {missing[0]!r}, "
                                             f"{missing_group(missing[0], self.hf_config, self.num_layers)}")
                full = self.mb._weight_to_mcore_format(g, [reader.get(x) for x in names])
                if getattr(_unwrap(model), "mtp_process", False) and len(names) == 1:
                    _check_mtp_copies(reader, names[0], full, self.num_layers, self.mtp_layers)
                size, rank = (etp, etp_rank) if ".mlp.experts." in g else (tp, tp_rank)
                shard = self.mb._weight_split_across_tp(g, full, param, size)[rank] if size > 1 else full
                if tuple(shard.shape) != tuple(param.shape):
                    raise ValueError(f"{names[0]}: shape {tuple(full.shape)} does not fit {local} "
                                     f"{tuple(param.shape)} at this layout (checkpoint and config disagree?)")
                with torch.no_grad():
                    param.copy_(shard.to(param.dtype))
                n += 1
        return n


class CheckpointMismatch(ValueError):
    """An HF checkpoint that lacks a tensor its config.json asks for (one line: the tensor, its group, the fix)."""


def missing_group(hf_name: str, hf: Any, num_layers: int) -> str:
    """What a tensor missing from a checkpoint belongs to, and what to change: the rest of a one-line error."""
    tail = "the checkpoint and its config.json describe different models"
    if hf_name == "lm_head.weight":
        return ("the output head: config.json says tie_word_embeddings: false; set it to true if the head is the "
                "input embedding, or use the checkpoint the head was saved with")
    if hf_name == "model.embed_tokens.weight":
        return f"the input embedding; {tail}"
    if mtp.is_mtp_hf_name(hf_name, num_layers):
        return ("a weight of the multi-token-prediction layers that config.json's num_nextn_predict_layers asks for "
                "(the checkpoint holds some of them): set trainer.mtp=init (fresh layers) or trainer.mtp=off (none)")
    if "e_score_correction_bias" in hf_name:
        return (f"the routers' expert bias, which config.json's routing (topk_method: "
                f"{getattr(hf, 'topk_method', 'noaux_tc')}) reads; {tail}")
    if "shared_expert" in hf_name:
        return (f"the shared experts that config.json asks for (n_shared_experts / shared_expert_intermediate_size); "
                f"set them to 0 if the model has none, else {tail}")
    if ".mlp.experts." in hf_name:
        experts = getattr(hf, "n_routed_experts", None) or getattr(hf, "num_experts", None)
        return f"a routed expert; config.json asks for {experts} experts per MoE layer, so {tail}"
    if hf_name.endswith(".bias"):
        bias = str(getattr(hf, "attention_bias", None)).lower()
        return f"a bias that config.json's attention_bias: {bias} (or the family's fixed biases) asks for; {tail}"
    return f"which config.json's sizes ask for; {tail}"


def _check_mtp_copies(reader: Any, hf_name: str, full: torch.Tensor, num_layers: int, layers: int) -> None:
    """The checkpoint's MTP-layer copies of the embedding and head should equal the main ones (Megatron and SGLang's
    NextN draft share them): a copy that differs is not loaded, said once here."""
    for copy in mtp.export_names(hf_name, num_layers, layers, False, True):
        if copy != hf_name and copy in reader:
            other = reader.get(copy)
            if other.shape != full.shape or not torch.equal(other.to(full.dtype), full):
                logger.warning("%s differs from %s: the MTP layer shares the model's %s (as SGLang's NextN draft "
                               "does), so the copy is not loaded and is exported equal to it", copy, hf_name,
                               hf_name)


class HFTensors(SafetensorsDir):
    """An HF directory's tensors by name; an FP8 block checkpoint's (DeepSeek-V3's) weights come dequantized."""

    def __init__(self, d: str | os.PathLike):
        super().__init__(d)
        self.fp8_block = fp8.dir_block(self.dir)

    def get(self, name: str) -> torch.Tensor:
        return fp8.dequantize_stored(name, super().get(name), super().get, self.fp8_block, self.dir)


def _unwrap(m: torch.nn.Module) -> torch.nn.Module:
    while hasattr(m, "module"):
        m = m.module
    return m


def bridge_for(models: Sequence[torch.nn.Module]) -> HFBridge:
    b = getattr(_unwrap(models[0]), "_mega_async_bridge", None)
    if b is None:
        raise ValueError("models were not built by mega_async.trainer.model.build_model (no bridge attached)")
    return b


def load_hf_weights(models: Sequence[torch.nn.Module], hf_dir: str | os.PathLike, progress: bool = False) -> int:
    """Load an HF safetensors directory into models built by `build_model` (any layout)."""
    return bridge_for(models).load(models, hf_dir, progress=progress)
