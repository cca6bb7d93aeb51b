"""HF <-> Megatron-Core: build GPT models from HF configs, load HF safetensors into any TP/PP/EP/ETP
layout, export full HF-named tensors from any layout.

mbridge supplies the per-family knowledge (TransformerConfig from the HF config, HF <-> Megatron
name tables, qkv and gate/up packing) behind this small interface, so it can be replaced. We
build the models ourselves with Megatron's local layer spec on CPU (Transformer Engine on GPU
when installed) and do the sharding and gathering here, so any layout works the same way.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger("mega_async.bridge")

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


def _with_legacy_fields(cfg: Any) -> Any:
    """transformers 5 moved `rope_theta` into rope_parameters and renamed num_experts; mbridge reads both."""
    if not hasattr(cfg, "rope_theta") or getattr(cfg, "rope_theta", None) is None:
        rp = getattr(cfg, "rope_parameters", None) or {}
        cfg.rope_theta = rp.get("rope_theta", 10000.0)
    if getattr(cfg, "num_experts", None) is None and getattr(cfg, "num_local_experts", None):
        cfg.num_experts = cfg.num_local_experts
    return cfg


class HFBridge:
    """One model family's HF <-> Megatron mapping for the current parallel layout (Megatron initialised)."""

    def __init__(self, hf_dir_or_config: Any, dtype: torch.dtype = torch.float32, layer_spec: str = "auto"):
        from mbridge import AutoBridge

        if layer_spec not in ("auto", "local", "te"):
            raise ValueError(f"layer_spec={layer_spec!r}: use auto, local or te")
        self.hf_config = _with_legacy_fields(_hf_config(hf_dir_or_config))
        self.dtype = dtype
        self.on_cpu = not torch.cuda.is_available()
        if layer_spec == "te" and not self._te_available():
            raise RuntimeError("layer_spec=te needs CUDA and transformer-engine (pip install -e .[gpu])")
        self.use_te = self._te_available() if layer_spec == "auto" else layer_spec == "te"
        self.mb = AutoBridge.from_config(self.hf_config, dtype=dtype)
        overrides: dict[str, Any] = dict(
            moe_grouped_gemm=self.use_te,  # local spec: SequentialMLP (one module per expert)
            persist_layer_norm=False,
            masked_softmax_fusion=False,
            bias_activation_fusion=self.use_te,
            bias_dropout_fusion=self.use_te,
            gradient_accumulation_fusion=False,
            sequence_parallel=self.mb.mpu.tp_size > 1,  # Megatron requires it for MoE with TP
            use_cpu_initialization=self.on_cpu,
            batch_p2p_comm=False,  # batched p2p gave wrong VPP gradients on gloo
            deterministic_mode=False,
            # losses are token sums; Megatron divides the gradients by the global token count
            # (all-reduced over DP) instead of averaging per micro-batch and per DP rank
            calculate_per_token_loss=True,
        )
        if self.mb.mpu.vpp_size is None or self.mb.mpu.pp_size == 1:
            overrides["overlap_p2p_comm"] = False
        self.mb.set_extra_args(**overrides)
        self.config = self.mb.config
        self.config.pipeline_model_parallel_size = self.mb.mpu.pp_size  # else every stage builds all layers
        from megatron.core.distributed import finalize_model_grads

        # DP reduce-scatter, TP all-reduce of sequence-parallel norm/router grads, token-count scaling
        self.config.finalize_model_grads_func = finalize_model_grads

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

    # ---- model -------------------------------------------------------------------------------
    def layer_spec(self, vp_stage: Optional[int]) -> Any:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_decoder_block_spec,
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )

        from mega_async.trainer.attention import use_packed_attention

        if self.is_moe:
            spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=self.use_te,
                                              normalization="RMSNorm", vp_stage=vp_stage)
        elif self.use_te:
            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=self.config.qk_layernorm)
        else:
            spec = get_gpt_layer_local_spec(qk_layernorm=self.config.qk_layernorm, normalization="RMSNorm")
        # local spec: packed 1-D micro-batches need THD attention (TE has it natively)
        return spec if self.use_te else use_packed_attention(spec)

    def build(self) -> list[torch.nn.Module]:
        """One GPTModel per virtual pipeline stage of this rank."""
        from megatron.core import parallel_state as mpu
        from megatron.core.models.gpt import GPTModel

        vpp = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
        models = []
        for stage in range(vpp):
            vp = stage if vpp > 1 else None
            m = GPTModel(
                config=self.config,
                transformer_layer_spec=self.layer_spec(vp),
                vocab_size=self.hf_config.vocab_size,
                max_sequence_length=self.hf_config.max_position_embeddings,
                pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                share_embeddings_and_output_weights=bool(getattr(self.hf_config, "tie_word_embeddings", False)),
                position_embedding_type="rope",
                rotary_base=self.hf_config.rope_theta,
                vp_stage=vp,
            )
            m.to(self.dtype)
            if torch.cuda.is_available():
                m.cuda()
            models.append(m)
        return models

    # ---- names ---------------------------------------------------------------------------------
    def global_name(self, model: torch.nn.Module, local: str) -> str:
        """Local parameter name -> mbridge's (Transformer Engine style) global name."""
        from megatron.core import parallel_state as mpu

        name = local
        m = re.match(r"decoder\.layers\.(\d+)\.", name)
        if m:
            layer = _unwrap(model).decoder.layers[int(m[1])].layer_number - 1
            name = f"decoder.layers.{layer}." + name[m.end():]
        name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
        if not self.is_moe:
            name = name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
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
        return self.mb._weight_name_mapping_mcore_to_hf(global_name)

    def tied(self) -> bool:
        return bool(getattr(self.hf_config, "tie_word_embeddings", False))

    # ---- load ----------------------------------------------------------------------------------
    def load(self, models: Sequence[torch.nn.Module], hf_dir: str | os.PathLike, progress: bool = False) -> int:
        """Every rank reads the HF tensors it needs and keeps its own TP/ETP shard. Returns tensors set."""
        from megatron.core import parallel_state as mpu

        reader = _SafetensorsDir(hf_dir)
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
                missing = [x for x in names if x not in reader]
                if missing:
                    raise KeyError(f"{hf_dir}: checkpoint lacks {missing[0]!r} (needed for {local})")
                full = self.mb._weight_to_mcore_format(g, [reader.get(x) for x in names])
                size, rank = (etp, etp_rank) if ".mlp.experts." in g else (tp, tp_rank)
                shard = self.mb._weight_split_across_tp(g, full, param, size)[rank] if size > 1 else full
                if tuple(shard.shape) != tuple(param.shape):
                    raise ValueError(f"{names[0]}: shape {tuple(full.shape)} does not fit {local} "
                                     f"{tuple(param.shape)} at this layout (checkpoint and config disagree?)")
                with torch.no_grad():
                    param.copy_(shard.to(param.dtype))
                n += 1
        return n

    # ---- export --------------------------------------------------------------------------------
    def export(self, models: Sequence[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (hf_name, full tensor) on every rank, gathered over TP, ETP, EP and PP."""
        from megatron.core import parallel_state as mpu

        pp_group = mpu.get_pipeline_model_parallel_group()
        pp_size, pp_rank = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
        mine = []
        for v, model in enumerate(models):
            params = dict(_unwrap(model).named_parameters())
            for local, t in _unwrap(model).state_dict().items():
                if "_extra_state" in local or t is None:
                    continue
                p = params.get(local, t)
                mine.append((v, local, self.global_name(model, local), tuple(t.shape), str(t.dtype).replace("torch.", ""),
                             bool(getattr(p, "tensor_model_parallel", False)), int(getattr(p, "partition_dim", -1))))
        every: list = [None] * pp_size
        dist.all_gather_object(every, mine, group=pp_group)
        seen: set[str] = set()
        for owner, entries in enumerate(every):
            for v, local, g, shape, dtype, is_tp, pdim in entries:
                if g in seen:  # tied output layer on the last stage duplicates the embedding
                    continue
                seen.add(g)
                if owner == pp_rank:
                    t = _unwrap(models[v]).state_dict()[local].detach().contiguous()
                else:
                    t = torch.empty(shape, dtype=getattr(torch, dtype), device=_device())
                if pp_size > 1:
                    dist.broadcast(t, src=dist.get_global_rank(pp_group, owner), group=pp_group)
                for name, full in self._gather(g, t, is_tp, pdim):
                    for hf_name, tensor in zip(*self.mb._weight_to_hf_format(name, full)):
                        if hf_name == "lm_head.weight" and self.tied():
                            continue
                        yield hf_name, tensor.cpu()

    def _gather(self, g: str, t: torch.Tensor, is_tp: bool, pdim: int) -> Iterator[tuple[str, torch.Tensor]]:
        from megatron.core import parallel_state as mpu

        if ".mlp.experts." in g:
            ep = mpu.get_expert_model_parallel_world_size()
            shards = _all_gather(t, mpu.get_expert_model_parallel_group()) if ep > 1 else [t]
            prefix, local_id = g.rsplit(".weight", 1)
            per_rank = self.config.num_moe_experts // ep
            first = int(local_id) - per_rank * mpu.get_expert_model_parallel_rank()
            for r, shard in enumerate(shards):
                name = f"{prefix}.weight{first + per_rank * r}"
                etp = mpu.get_expert_tensor_parallel_world_size()
                parts = _all_gather(shard, mpu.get_expert_tensor_parallel_group()) if etp > 1 else [shard]
                yield name, self._merge(name, parts, pdim)
            return
        tp = mpu.get_tensor_model_parallel_world_size()
        if is_tp and tp > 1:
            yield g, self._merge(g, _all_gather(t, mpu.get_tensor_model_parallel_group()), pdim)
        else:
            yield g, t

    def _merge(self, g: str, parts: list[torch.Tensor], pdim: int) -> torch.Tensor:
        """Inverse of the TP split: qkv rows by KV group, gate/up halves separately, else the partition dim."""
        if len(parts) == 1:
            return parts[0]
        if "linear_fc1.weight" in g and self.config.gated_linear_unit:
            gates, ups = zip(*(p.chunk(2) for p in parts))
            return torch.cat([torch.cat(gates), torch.cat(ups)])
        if "linear_fc2.weight" in g:
            return torch.cat(parts, dim=1)
        return torch.cat(parts, dim=0 if "linear_qkv" in g or pdim < 0 else pdim)


class _SafetensorsDir:
    """Lazy access to the tensors of an HF directory (sharded or not), by name."""

    def __init__(self, d: str | os.PathLike):
        from safetensors import safe_open

        self.dir = Path(d)
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {self.dir}: not an HF checkpoint directory")
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    self._where[k] = f
        self._open: dict[Path, Any] = {}
        self._safe_open = safe_open

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        f = self._where[name]
        if f not in self._open:
            self._open[f] = self._safe_open(str(f), framework="pt")
        return self._open[f].get_tensor(name)

    def names(self) -> list[str]:
        return list(self._where)


def _unwrap(m: torch.nn.Module) -> torch.nn.Module:
    while hasattr(m, "module"):
        m = m.module
    return m


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _all_gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def bridge_for(models: Sequence[torch.nn.Module]) -> HFBridge:
    b = getattr(_unwrap(models[0]), "_mega_async_bridge", None)
    if b is None:
        raise ValueError("models were not built by mega_async.trainer.model.build_model (no bridge attached)")
    return b


def load_hf_weights(models: Sequence[torch.nn.Module], hf_dir: str | os.PathLike, progress: bool = False) -> int:
    """Load an HF safetensors directory into models built by `build_model` (any layout)."""
    return bridge_for(models).load(models, hf_dir, progress=progress)


def export_hf_weights(models: Sequence[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors from any layout; every rank iterates and gets every tensor."""
    return bridge_for(models).export(models)


def save_hf_checkpoint(models: Sequence[torch.nn.Module], out_dir: str | os.PathLike, src_dir: Any = None,
                       max_shard_bytes: int = 2 << 30, progress: bool = False) -> dict[str, int]:
    """Export to HF safetensors shards (+ index, config, tokenizer copied from `src_dir`); rank 0 writes.

    Written to a temporary directory and renamed at the end: an interrupted save leaves no partial checkpoint.
    """
    import shutil

    from safetensors.torch import save_file

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    shard: dict[str, torch.Tensor] = {}
    shards: list[dict[str, torch.Tensor]] = []
    size = total = count = 0
    tensors: Any = export_hf_weights(models)
    if progress and rank0:
        from tqdm import tqdm

        tensors = tqdm(tensors, desc="export HF tensors", unit="tensor")
    for name, t in tensors:
        if not rank0:
            continue
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            shards.append(shard)
            shard, size = {}, 0
        shard[name] = t.contiguous()
        size += nbytes
        total += nbytes
        count += 1
    if rank0:
        if shard:
            shards.append(shard)
        weight_map = {}
        for i, s in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(s, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in s})
        if len(shards) > 1:
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        cfg = bridge_for(models).hf_config
        if src_dir is not None and Path(src_dir).is_dir():
            for f in Path(src_dir).iterdir():
                if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                    shutil.copy2(f, tmp / f.name)
        if not (tmp / "config.json").exists():
            cfg.save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    if dist.is_initialized():
        dist.barrier()
    return {"tensors": count, "bytes": total}
