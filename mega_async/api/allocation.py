"""Allocation strings (AReaL style): which backends run at which parallel layout. Pure Python.

    sglang:d4t2+megatron:d2p2t2e4              inference part + trainer part
    sglang[rollout]:d4+megatron[actor]:d4p2   named parts
    megatron:(attn:d2p2t2c2|ffn:d2p2t1e4)      MoE hybrid: attention and expert layouts

Letters: d data, p pipeline, t tensor, c context, e expert parallel; v virtual pipeline stages
per rank (trainer only, our extension). EP does not add GPUs: a part's world is d*p*t*c. In the
plain form experts are not tensor-split when EP > 1 (ETP = 1) and follow TP when EP = 1; the
hybrid form sets ETP = the ffn's t and expert-DP = the ffn's d explicitly.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

INFERENCE_BACKENDS = ("sglang", "embedded", "vllm")
TRAINER_BACKENDS = ("megatron",)


class AllocationError(ValueError):
    def __init__(self, message: str):
        super().__init__(f"AllocationError: {message}")


@dataclass(frozen=True)
class ParallelStrategy:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: the world of one pipeline stage divided by the expert layout."""
        return self.dp * self.tp * self.cp // (self.ep * self.etp)

    def __str__(self) -> str:
        s = f"d{self.dp}p{self.pp}t{self.tp}"
        s += f"c{self.cp}" if self.cp > 1 else ""
        s += f"e{self.ep}" if self.ep > 1 else ""
        s += f" etp{self.etp}" if self.etp != (1 if self.ep > 1 else self.tp) else ""  # only when not the default
        return s + (f" vpp{self.vpp}" if self.vpp > 1 else "")


@dataclass(frozen=True)
class AllocationPart:
    backend: str
    name: Optional[str]
    strategy: ParallelStrategy


@dataclass(frozen=True)
class Allocation:
    inference: Optional[AllocationPart]
    trainer: Optional[AllocationPart]
    source: str = ""

    @property
    def train(self) -> ParallelStrategy:
        if self.trainer is None:
            raise AllocationError(f"{self.source!r} has no trainer part (e.g. +megatron:d2)")
        return self.trainer.strategy

    @property
    def total_gpus(self) -> int:
        return sum(p.strategy.world_size for p in (self.inference, self.trainer) if p is not None)


_DIMS = re.compile(r"([a-z])(\d+)")


def _dims(spec: str, allowed: str, where: str) -> dict[str, int]:
    if not spec or not re.fullmatch(r"(?:[a-z]\d+)+", spec):
        raise AllocationError(f"{where}: {spec!r} is not a list of <letter><size> like d2p2t2e4")
    out: dict[str, int] = {}
    for letter, num in _DIMS.findall(spec):
        if letter not in allowed:
            raise AllocationError(f"{where}: unknown dimension {letter!r} in {spec!r} (use {', '.join(allowed)})")
        if letter in out:
            raise AllocationError(f"{where}: dimension {letter!r} given twice in {spec!r}")
        n = int(num)
        if n < 1:
            raise AllocationError(f"{where}: {letter}{num} must be >= 1")
        out[letter] = n
    return out


def _plain(spec: str, where: str, trainer: bool) -> ParallelStrategy:
    d = _dims(spec, "dptcev" if trainer else "dptce", where)
    ep, tp = d.get("e", 1), d.get("t", 1)
    s = ParallelStrategy(dp=d.get("d", 1), pp=d.get("p", 1), tp=tp, cp=d.get("c", 1), ep=ep,
                         etp=1 if ep > 1 else tp, vpp=d.get("v", 1))
    if trainer:
        _check_expert_layout(s, where)
    return s


def _check_expert_layout(s: ParallelStrategy, where: str) -> None:
    dense = s.dp * s.tp * s.cp
    if dense % (s.ep * s.etp):
        raise AllocationError(
            f"{where}: expert layout ep={s.ep} x etp={s.etp} = {s.ep * s.etp} does not divide "
            f"dp x tp x cp = {dense} GPUs per pipeline stage"
        )


def _hybrid(spec: str, where: str) -> ParallelStrategy:
    m = re.fullmatch(r"\(\s*attn:([a-z0-9]+)\s*\|\s*ffn:([a-z0-9]+)\s*\)", spec)
    if m is None:
        raise AllocationError(f"{where}: hybrid form must be (attn:<dims>|ffn:<dims>), got {spec!r}")
    a = _dims(m[1], "dptcv", f"{where} attn")
    f = _dims(m[2], "dpte", f"{where} ffn")
    if a.get("p", 1) != f.get("p", 1):
        raise AllocationError(f"{where}: pipeline sizes differ: attn p={a.get('p', 1)}, ffn p={f.get('p', 1)}")
    attn_world = a.get("d", 1) * a.get("p", 1) * a.get("t", 1) * a.get("c", 1)
    ffn_world = f.get("d", 1) * f.get("p", 1) * f.get("t", 1) * f.get("e", 1)
    if attn_world != ffn_world:
        raise AllocationError(f"{where}: world sizes differ: attn {attn_world} GPUs, ffn {ffn_world} GPUs")
    return ParallelStrategy(dp=a.get("d", 1), pp=a.get("p", 1), tp=a.get("t", 1), cp=a.get("c", 1),
                            ep=f.get("e", 1), etp=f.get("t", 1), vpp=a.get("v", 1))


def _part(text: str) -> AllocationPart:
    m = re.fullmatch(r"\s*([a-z_]+)(?:\[([A-Za-z0-9_\-]+)\])?:(.+?)\s*", text)
    if m is None:
        raise AllocationError(f"{text!r} is not <backend>[<name>]:<dims>, e.g. megatron:d2p2t2")
    backend, name, spec = m[1], m[2], m[3].replace(" ", "")
    where = f"{backend}{f'[{name}]' if name else ''}"
    if backend in TRAINER_BACKENDS:
        strategy = _hybrid(spec, where) if spec.startswith("(") else _plain(spec, where, trainer=True)
    elif backend in INFERENCE_BACKENDS:
        if spec.startswith("("):
            raise AllocationError(f"{where}: the attn|ffn hybrid form is for the trainer (megatron) only")
        strategy = _plain(spec, where, trainer=False)
    else:
        raise AllocationError(f"unknown backend {backend!r} (inference: {', '.join(INFERENCE_BACKENDS)}; "
                              f"trainer: {', '.join(TRAINER_BACKENDS)})")
    return AllocationPart(backend, name, strategy)


def parse_allocation(s: str) -> Allocation:
    """Parse an allocation string; raises AllocationError naming the bad part."""
    if not isinstance(s, str) or not s.strip():
        raise AllocationError("empty allocation string; e.g. sglang:d4t2+megatron:d2p2t2e4")
    inference = trainer = None
    # split on '+' outside parentheses
    parts, depth, cur = [], 0, ""
    for ch in s.strip():
        depth += ch == "("
        depth -= ch == ")"
        if depth < 0:
            raise AllocationError(f"unbalanced parentheses in {s!r}")
        if ch == "+" and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise AllocationError(f"unbalanced parentheses in {s!r}")
    parts.append(cur)
    names: dict[str, str] = {}
    for text in parts:
        p = _part(text)
        if p.name is not None:
            if p.name in names:
                raise AllocationError(f"{s!r}: role name [{p.name}] is given to both {names[p.name]} and "
                                      f"{p.backend}; give each part its own name (e.g. sglang[rollout]+megatron[actor])")
            names[p.name] = p.backend
        if p.backend in TRAINER_BACKENDS:
            if trainer is not None:
                raise AllocationError(f"{s!r} has two trainer parts")
            trainer = p
        else:
            if inference is not None:
                raise AllocationError(f"{s!r} has two inference parts")
            inference = p
    return Allocation(inference, trainer, s)


def as_strategy(allocation: Any) -> ParallelStrategy:
    if isinstance(allocation, ParallelStrategy):
        return allocation
    if isinstance(allocation, str):
        allocation = parse_allocation(allocation)
    if isinstance(allocation, Allocation):
        return allocation.train
    raise TypeError(f"allocation must be a string, Allocation or ParallelStrategy, got {type(allocation).__name__}")


def validate_for_model(s: ParallelStrategy, hf_config: Any) -> None:
    """Check the layout fits the model before any process starts; the message names both numbers."""
    c = hf_config
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    layers = c.num_hidden_layers
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or getattr(c, "n_routed_experts", None)
    if heads % s.tp:
        raise AllocationError(f"tp={s.tp} does not divide num_attention_heads={heads}")
    if kv % s.tp:
        raise AllocationError(f"tp={s.tp} does not divide num_key_value_heads={kv}")
    if layers % (s.pp * s.vpp):
        raise AllocationError(f"pp x vpp = {s.pp} x {s.vpp} = {s.pp * s.vpp} does not divide num_hidden_layers={layers}")
    if s.ep > 1 and not experts:
        raise AllocationError(f"ep={s.ep} but the model ({c.model_type}) has no experts")
    if experts and experts % s.ep:
        raise AllocationError(f"ep={s.ep} does not divide num_experts={experts}")
    if s.vpp > 1 and s.pp == 1:
        raise AllocationError(f"vpp={s.vpp} needs pp > 1")
    ffn = getattr(c, "moe_intermediate_size", None) if experts else getattr(c, "intermediate_size", None)
    if ffn and ffn % s.etp:
        raise AllocationError(f"etp={s.etp} does not divide the expert FFN size {ffn}")
