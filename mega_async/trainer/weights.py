"""The resharder: Megatron shards -> full HF-named tensors, per pipeline stage, in byte-budget buckets.

Each pipeline stage streams its own layers under their global layer numbers; tensor-parallel
shards are gathered in the TP group, experts over EP (global expert ids) and expert-TP, vocab
padding is dropped, and a layer's experts always travel in one bucket. Only the stage head
(data-parallel rank 0, TP rank 0, CP rank 0 of its stage) receives the tensors, one bucket at a
time, so no rank ever holds the whole model. `export_hf_weights` (every rank gets every tensor)
and `save_hf_checkpoint` (each stage head writes its own shard files) are built on it.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from mega_async.bridge.model_cards import copy_model_files

logger = logging.getLogger("mega_async.trainer.weights")

DEFAULT_BUCKET_BYTES = 512 << 20
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclass
class Bucket:
    """Full HF-named tensors of one pipeline stage, in the order they are sent."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        self.names.append(name)
        self.tensors.append(t)
        self.nbytes += t.numel() * t.element_size()

    @property
    def dtypes(self) -> list[str]:
        return [str(t.dtype).replace("torch.", "") for t in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(t.shape) for t in self.tensors]

    def __len__(self) -> int:
        return len(self.names)


@dataclass
class _Param:
    chunk: int  # virtual pipeline chunk on this rank
    local: str  # state_dict key in that chunk
    name: str  # mbridge's global (TE-style) Megatron name
    shape: tuple
    dtype: str
    is_tp: bool
    pdim: int

    @property
    def is_expert(self) -> bool:
        return ".mlp.experts." in self.name

    @property
    def unit(self) -> str:
        """Tensors of one unit never split across buckets: a layer's experts form one unit."""
        m = _LAYER.match(self.name)
        return f"experts.{m[1]}" if self.is_expert and m else self.name


def _unwrap(m: torch.nn.Module) -> torch.nn.Module:
    while hasattr(m, "module"):
        m = m.module
    return m


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _all_gather_flat(ts: list[torch.Tensor], group: Any) -> list[list[torch.Tensor]]:
    """All-gather several same-dtype tensors as one flat buffer; returns [rank][tensor] views."""
    flat = torch.cat([t.reshape(-1) for t in ts])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, flat, group=group)
    res = []
    for buf in out:
        parts, i = [], 0
        for t in ts:
            parts.append(buf[i:i + t.numel()].view(t.shape))
            i += t.numel()
        res.append(parts)
    return res


def _all_gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


class Resharder:
    """Streams this pipeline stage's weights as full HF tensors. Every rank of the stage calls the
    iterators (they run collectives); only `is_stage_head` ranks receive tensors."""

    def __init__(self, models: Sequence[torch.nn.Module], bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        from megatron.core import parallel_state as mpu

        from mega_async.bridge import bridge_for

        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
        self.models = list(models)
        self.bridge = bridge_for(self.models)
        self.bucket_bytes = bucket_bytes
        self.pp_rank = mpu.get_pipeline_model_parallel_rank()
        self.pp_size = mpu.get_pipeline_model_parallel_world_size()
        dense_zero = mpu.get_data_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0
        self.is_stage_head = dense_zero and mpu.get_tensor_model_parallel_rank() == 0
        # who takes part in the gathers the stage head needs: its TP group (dense) and the expert
        # ranks of expert-data-parallel rank 0 (EP x ETP, which the head belongs to)
        self._dense = dense_zero
        self._expert = mpu.get_expert_data_parallel_rank() == 0
        self.vocab_size = int(self.bridge.hf_config.vocab_size)
        self.params = self._local_params()
        self.stats: dict[str, float] = {}

    def _local_params(self) -> list[_Param]:
        out = []
        for v, model in enumerate(self.models):
            m = _unwrap(model)
            params = dict(m.named_parameters())
            for local, t in m.state_dict().items():
                if "_extra_state" in local or t is None:
                    continue
                p = params.get(local, t)
                out.append(_Param(v, local, self.bridge.global_name(model, local), tuple(t.shape),
                                  str(t.dtype).replace("torch.", ""), bool(getattr(p, "tensor_model_parallel", False)),
                                  int(getattr(p, "partition_dim", -1))))
        return out

    def _state_dicts(self) -> list[dict[str, torch.Tensor]]:
        return [_unwrap(m).state_dict() for m in self.models]

    # ---- gather ------------------------------------------------------------------------------
    def _full(self, p: _Param, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """A dense parameter as one Megatron-named full tensor (gathered over TP when it is split)."""
        from megatron.core import parallel_state as mpu

        tp = mpu.get_tensor_model_parallel_world_size()
        if p.is_tp and tp > 1:
            yield p.name, self._merge(p.name, _all_gather(t, mpu.get_tensor_model_parallel_group()), p.pdim)
        else:
            yield p.name, t

    def _merge(self, name: str, parts: list[torch.Tensor], pdim: int) -> torch.Tensor:
        """Inverse of the TP split: qkv rows by KV group, gate/up halves separately, else the partition dim."""
        if len(parts) == 1:
            return parts[0]
        if "linear_fc1.weight" in name and self.bridge.config.gated_linear_unit:
            gates, ups = zip(*(x.chunk(2) for x in parts))
            return torch.cat([torch.cat(gates), torch.cat(ups)])
        if "linear_fc2.weight" in name:
            return torch.cat(parts, dim=1)
        return torch.cat(parts, dim=0 if "linear_qkv" in name or pdim < 0 else pdim)

    def _hf(self, name: str, full: torch.Tensor, chunk: int) -> Iterator[tuple[str, torch.Tensor]]:
        tied = self.bridge.tied()
        for hf_name, tensor in zip(*self.bridge.to_hf(name, full)):
            if hf_name == "lm_head.weight" and tied:
                continue  # the output layer duplicates the embedding
            if hf_name in ("lm_head.weight", "model.embed_tokens.weight") and tensor.shape[0] > self.vocab_size:
                tensor = tensor[: self.vocab_size]  # vocab padding is Megatron's, not the model's
            tensor = tensor.contiguous()
            # the MTP layers' copies of the embedding and head (own storage: safetensors refuses shared tensors)
            for i, out in enumerate(self.bridge.export_names(hf_name, self.models[chunk])):
                yield out, tensor if i == 0 else tensor.clone()

    def _grouped(self, everything: bool) -> Iterator[list[_Param]]:
        unit: list[_Param] = []
        for p in self.params:
            if not (everything or (self._expert if p.is_expert else self._dense)):
                continue
            if unit and p.unit != unit[-1].unit:
                yield unit
                unit = []
            unit.append(p)
        if unit:
            yield unit

    def _full_experts(self, ps: list[_Param], ts: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """A layer's experts with one all-gather over ETP and one over EP (not one per expert tensor)."""
        from megatron.core import parallel_state as mpu

        etp = mpu.get_expert_tensor_parallel_world_size()
        if etp > 1:
            per_rank = _all_gather_flat(ts, mpu.get_expert_tensor_parallel_group())
            ts = [self._merge(p.name, [shards[i] for shards in per_rank], p.pdim) for i, p in enumerate(ps)]
        ep = mpu.get_expert_model_parallel_world_size()
        per_ep = _all_gather_flat(ts, mpu.get_expert_model_parallel_group()) if ep > 1 else [ts]
        n_local = self.bridge.config.num_moe_experts // ep
        offset = n_local * mpu.get_expert_model_parallel_rank()
        for r, full in enumerate(per_ep):
            for p, t in zip(ps, full):
                prefix, local_id = p.name.rsplit(".weight", 1)
                yield f"{prefix}.weight{int(local_id) - offset + n_local * r}", t

    def units(self, everything: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """This stage's HF tensors grouped in units (a layer's experts together). On ranks that take no
        part (and with `everything=False`, on every rank but the stage head) the gathers run and
        nothing is yielded; `everything=True` makes every rank of the stage gather and receive all."""
        keep = everything or self.is_stage_head
        sds = self._state_dicts()  # once per pass: state_dict() walks the whole module tree
        for ps in self._grouped(everything):
            ts = [sds[p.chunk][p.local].detach() for p in ps]
            if ps[0].is_expert:  # a unit is a layer's experts (one dtype) or one dense parameter
                named = self._full_experts(ps, ts)
            else:
                named = (x for p, t in zip(ps, ts) for x in self._full(p, t))
            unit = [hf for name, full in named for hf in self._hf(name, full, ps[0].chunk)] if keep else \
                [None for _ in named]
            if keep:
                yield unit

    def buckets(self) -> Iterator[Bucket]:
        """This stage's units packed into buckets of at most `bucket_bytes` (a unit larger than the
        budget travels alone). Every rank of the stage must drain it; only the head gets buckets."""
        bucket = Bucket()
        t0 = time.perf_counter()
        gather_s = 0.0
        n = 0
        for unit in self.units():
            gather_s += time.perf_counter() - t0
            size = sum(t.numel() * t.element_size() for _, t in unit)
            if len(bucket) and bucket.nbytes + size > self.bucket_bytes:
                n += 1
                yield bucket
                bucket = Bucket()
            for name, t in unit:
                bucket.add(name, t)
            t0 = time.perf_counter()
        gather_s += time.perf_counter() - t0
        if len(bucket):
            n += 1
            yield bucket
        self.stats = {"gather_s": gather_s, "buckets": n}


def export_hf_weights(models: Sequence[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors from any layout; every rank iterates and gets every tensor (the stages'
    tensors are broadcast over PP, stage by stage)."""
    from megatron.core import parallel_state as mpu

    rs = Resharder(models)
    if rs.pp_size == 1:
        for unit in rs.units(everything=True):
            yield from ((n, t.cpu()) for n, t in unit)
        return
    group = mpu.get_pipeline_model_parallel_group()
    for stage in range(rs.pp_size):
        src = dist.get_global_rank(group, stage)
        mine = rs.units(everything=True) if stage == rs.pp_rank else iter(())
        while True:
            unit = next(mine, None) if stage == rs.pp_rank else None
            meta = [None if unit is None else [(n, tuple(t.shape), str(t.dtype).replace("torch.", "")) for n, t in unit]]
            dist.broadcast_object_list(meta, src=src, group=group)
            if meta[0] is None:
                break
            for i, (name, shape, dtype) in enumerate(meta[0]):
                t = unit[i][1].to(_device()) if unit is not None else torch.empty(shape, dtype=getattr(torch, dtype),
                                                                               device=_device())
                dist.broadcast(t, src=src, group=group)
                yield name, t.cpu()


def partial_dir(out: Path, kind: str = "hf", legacy: bool = False) -> Path:
    """`<out>.partial.<random>`, made by rank 0 and named to every rank: the conversion writes there and renames it
    to `out` at the end, so two conversions to one output each finish whole (the last rename wins) and a killed
    one leaves only its own partial folder. First, on rank 0, `out` must be replaceable by an export of `kind`
    (`check_replaceable`): else OutputInUse on every rank, and nothing is made."""
    import tempfile

    from mega_async.utils.outputs import OutputInUse, check_replaceable

    name: list = [None, None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            check_replaceable(out, kind, legacy)
            out.parent.mkdir(parents=True, exist_ok=True)
            name = [tempfile.mkdtemp(prefix=out.name + ".partial.", dir=out.parent), None]
        except OutputInUse as e:
            name = [None, str(e)]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    if name[1] is not None:
        raise OutputInUse(name[1])
    return Path(name[0])


def swap_in(tmp: Path, out: Path, kind: str = "hf", legacy: bool = False) -> None:
    """Rename the finished folder `tmp` (marked as an export of `kind` here, its modes following the umask) to `out`, replacing an earlier export of
    that kind (moved aside under a name of its own, then removed; anything else there is refused: OutputInUse, and
    `tmp` is left to the caller): a second writer finishing at the same moment never fails on a non-empty `out`."""
    import errno
    import tempfile

    from mega_async.utils.outputs import check_replaceable, follow_umask, mark

    mark(tmp, kind)
    follow_umask(tmp)
    while True:
        try:
            os.replace(tmp, out)
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        check_replaceable(out, kind, legacy)
        old = Path(tempfile.mkdtemp(prefix=out.name + ".old.", dir=out.parent))
        try:
            os.replace(out, old)  # onto the empty folder just made: always allowed
        except FileNotFoundError:  # the other writer moved it first
            old.rmdir()
            continue
        shutil.rmtree(old, ignore_errors=True)


def save_hf_checkpoint(models: Sequence[torch.nn.Module], out_dir: str | os.PathLike, src_dir: Any = None,
                       max_shard_bytes: int = 2 << 30, progress: bool = False,
                       fp8_block: Any = None, legacy: bool = False, dtype_name: Any = None) -> dict[str, int]:
    """HF safetensors (+ index, config, tokenizer files from `src_dir`), written by each pipeline stage's
    head for its own layers (a shared filesystem across nodes), into a partial folder of its own
    (`<out>.partial.<random>`), swapped in whole at the end: two exports to one output each finish whole.
    `fp8_block` (rows, cols): the linear weights go as an FP8 block checkpoint (`mega_async.bridge.fp8`). An `out`
    that holds anything but an earlier HF export is refused before any work (`mega_async.utils.outputs`; `legacy`:
    a run's own export folder from before the mark is replaced too)."""
    from safetensors.torch import save_file

    from mega_async.bridge import fp8

    rs = Resharder(models, bucket_bytes=max_shard_bytes)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    out = Path(out_dir)
    tmp = partial_dir(out, "hf", legacy)
    try:
        written: list[tuple[str, list[str], int]] = []
        buckets: Any = rs.buckets()
        if progress and rs.is_stage_head:
            from tqdm import tqdm

            buckets = tqdm(buckets, desc=f"export HF shards (stage {rs.pp_rank})", unit="shard")
        for i, b in enumerate(buckets):
            fname = f"model-pp{rs.pp_rank:03d}-{i:05d}.safetensors"
            named = dict(zip(b.names, b.tensors) if fp8_block is None else fp8.quantize_named(
                zip(b.names, b.tensors), fp8_block, fp8.skipped_modules(rs.bridge.hf_config)))
            save_file(named, str(tmp / fname), metadata={"format": "pt"})
            written.append((fname, list(named), sum(t.numel() * t.element_size() for t in named.values())))
        every: list = [written]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, written)
        files = [w for per_rank in every for w in per_rank]
        total = sum(nb for _, _, nb in files)
        count = sum(len(names) for _, names, _ in files)
        if rank0:
            if len(files) == 1:
                os.replace(tmp / files[0][0], tmp / "model.safetensors")
            else:
                weight_map = {n: f for f, names, _ in files for n in names}
                (tmp / "model.safetensors.index.json").write_text(
                    json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
            if src_dir is not None and Path(src_dir).is_dir():
                copy_model_files(src_dir, tmp)
            if not (tmp / "config.json").exists():
                rs.bridge.hf_config.save_pretrained(str(tmp))
            config = json.loads((tmp / "config.json").read_text())  # quantization_config as the weights are written
            fixed = fp8.config_for(config, fp8_block)
            if int(config.get("num_nextn_predict_layers") or 0) != rs.bridge.mtp_layers:
                fixed = {**fixed, "num_nextn_predict_layers": rs.bridge.mtp_layers}  # the MTP layers written
            if fixed != config:
                (tmp / "config.json").write_text(json.dumps(fixed, indent=2) + "\n")
            if dtype_name is not None:  # config.json says what the weights are (`convert --dtype`)
                from mega_async.bridge.model_cards import set_config_dtype

                set_config_dtype(tmp, dtype_name)
            swap_in(tmp, out, "hf", legacy)
    except BaseException:
        if rank0:  # a failed or interrupted export leaves nothing behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dist.is_initialized():
        dist.barrier()
    return {"tensors": count, "bytes": total}

