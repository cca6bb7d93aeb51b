"""Which node runs what: SGLang servers first (a server smaller than a node shares it, one larger spans
several with --nnodes/--node-rank), the trainer on the remaining nodes, the driver on the trainer head
(trainer rank 0). A one-node job puts the servers on the GPUs after the trainer's. Pure: no I/O.

Checked before anything is submitted, each failure one line naming what does not fit: the allocation
against the nodes and GPUs, the layout against the model (heads, experts, layers) and memory (fit.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from mega_async.api.allocation import Allocation, AllocationError, validate_for_model
from mega_async.api.config import TrainerConfig
from mega_async.launch.slurm import fit


class LaunchError(ValueError):
    """The job does not fit; one line naming what and how to fix it."""

    def __init__(self, message: str):
        super().__init__(f"LaunchError: {message}")


@dataclass(frozen=True)
class ServerPlacement:
    index: int
    nodes: tuple[int, ...]  # node indices in the allocation; several = one server spanning nodes
    gpus: int  # GPUs of the server (its tp); CPU jobs: 1
    base_gpu: int  # first GPU on its node (servers sharing a node, or after the trainer's on a one-node job)
    ep: int = 1
    dp_attention: int = 1  # SGLang --dp-size with --enable-dp-attention (1 = off)


@dataclass
class JobPlan:
    nodes: int
    gpus_per_node: int  # CPU jobs: slots (trainer ranks + servers) per node
    gpu: bool
    backend: str
    servers: list[ServerPlacement]
    trainer_nodes: tuple[int, ...]
    trainer_world: int
    router: bool  # smg in front of the servers (inference.router=smg), started by the job
    notes: list[str] = field(default_factory=list)

    @property
    def trainer_tasks_per_node(self) -> int:
        return self.trainer_world // len(self.trainer_nodes)

    def describe(self) -> list[str]:
        """What the launcher decided, one line each (printed by --dry-run and into the job's log)."""
        unit = "GPUs" if self.gpu else "slots"
        out = [f"{self.nodes} node(s) x {self.gpus_per_node} {unit}; inference backend {self.backend}"]
        for s in self.servers:
            extra = f", ep {s.ep}" if s.ep > 1 else ""
            extra += f", dp-attention {s.dp_attention}" if s.dp_attention > 1 else ""
            where = (f"nodes {s.nodes[0]}-{s.nodes[-1]} (--nnodes {len(s.nodes)})" if len(s.nodes) > 1
                     else f"node {s.nodes[0]} from {'GPU' if self.gpu else 'slot'} {s.base_gpu}")
            out.append(f"server {s.index}: {s.gpus} {unit} on {where}{extra}")
        if self.router:
            out.append(f"smg (inference.router=smg) on node {self.servers[0].nodes[0]} in front of "
                       f"{len(self.servers)} server(s)")
        tn = self.trainer_nodes
        out.append(f"trainer: {self.trainer_world} ranks ({self.trainer_tasks_per_node} per node) on "
                   f"node{'s' if len(tn) > 1 else ''} {tn[0]}{f'-{tn[-1]}' if len(tn) > 1 else ''}; "
                   f"driver = rank 0 on node {tn[0]}")
        return out + self.notes


def plan_job(alloc: Allocation, nodes: int, gpus_per_node: int, *, backend: str, hf_config: Any = None,
             dtype: str = "bfloat16", gpu_memory_gib: float = 80.0, router: bool = False,
             device: str = "gpu", trainer: Any = None) -> JobPlan:
    """Place the allocation on `nodes` x `gpus_per_node`; raises LaunchError naming what does not fit. `router`:
    the job starts smg in front of the servers (inference.router=smg). `trainer`: the run's trainer section (micro-batch
    tokens, activation recompute, MTP), for the per-stage fit (its lines go into the plan's notes)."""
    if nodes < 1 or gpus_per_node < 1:
        raise LaunchError(f"--nodes={nodes} and --gpus-per-node={gpus_per_node} must both be >= 1")
    if alloc.inference is None or alloc.trainer is None:
        raise LaunchError(f"parallel.allocation={alloc.source!r} needs an inference and a trainer part, "
                          "e.g. sglang:d2t8+megatron:d8")
    gpu = backend == "sglang" and device == "gpu"  # launch.device=cpu: SGLang's CPU engine, no GPUs asked for
    inf = alloc.inference.strategy
    n_srv, tp = inf.dp, inf.tp
    if inf.pp > 1 or inf.cp > 1:
        raise LaunchError(f"inference part {alloc.inference.backend}:{inf}: servers take d (count), t and e only")
    if backend == "embedded" and (tp > 1 or inf.ep > 1):
        raise LaunchError(f"inference.backend={backend} runs one rank per server; the inference part asks t{tp} "
                          f"e{inf.ep}: use inference.backend=sglang for tensor/expert-parallel servers")
    if inf.ep > 1 and tp % inf.ep:
        raise LaunchError(f"inference part: SGLang needs --ep-size ({inf.ep}) to divide --tp-size ({tp})")
    world = alloc.train.world_size
    unit = "GPUs" if gpu else "slots"
    dp_attn = _dp_attention(tp, inf.ep, hf_config)
    fits: list[str] = []
    if hf_config is not None:
        fits = _check_model(alloc, hf_config, dtype, gpu_memory_gib if gpu else None, trainer, dp_attn)
    total = nodes * gpus_per_node
    need = n_srv * tp + world
    if nodes == 1:
        if need > total or (gpu and need != total):
            raise LaunchError(f"{alloc.source} needs {need} {unit} ({n_srv} x {tp} for the servers + {world} for the "
                              f"trainer) but 1 node x {gpus_per_node} has {total}: set --gpus-per-node {need}")
        servers = [ServerPlacement(i, (0,), tp, world + i * tp, inf.ep, dp_attn) for i in range(n_srv)]
        return JobPlan(1, gpus_per_node, gpu, backend, servers, (0,), world, router, fits)
    servers, server_nodes = _place_servers(n_srv, tp, inf.ep, dp_attn, gpus_per_node, unit)
    if world % gpus_per_node:
        raise LaunchError(f"trainer part megatron:{alloc.train} has {world} ranks, not whole nodes of {gpus_per_node} "
                          f"{unit}: make d x p x t x c a multiple of {gpus_per_node}")
    t_nodes = world // gpus_per_node
    if server_nodes + t_nodes != nodes:
        raise LaunchError(f"{alloc.source} takes {server_nodes + t_nodes} nodes of {gpus_per_node} {unit} "
                          f"({server_nodes} for {n_srv} server(s), {t_nodes} for the trainer) but --nodes={nodes}: "
                          f"pass --nodes {server_nodes + t_nodes} or change parallel.allocation")
    return JobPlan(nodes, gpus_per_node, gpu, backend, servers, tuple(range(server_nodes, nodes)), world, router,
                   fits)


def _place_servers(n: int, tp: int, ep: int, dp_attn: int, g: int, unit: str) -> tuple[list[ServerPlacement], int]:
    if tp >= g:
        if tp % g:
            raise LaunchError(f"a server of {tp} {unit} does not span whole nodes of {g}: make t a multiple of {g}")
        span = tp // g
        return [ServerPlacement(i, tuple(range(i * span, (i + 1) * span)), tp, 0, ep, dp_attn) for i in range(n)], n * span
    if g % tp or (n * tp) % g:
        raise LaunchError(f"{n} server(s) x {tp} {unit} do not fill whole nodes of {g} {unit}: use a server count "
                          f"that is a multiple of {g // tp if g % tp == 0 else g} or t = {g}")
    per = g // tp
    return [ServerPlacement(i, (i // per,), tp, (i % per) * tp, ep, dp_attn) for i in range(n)], n * tp // g


def _dp_attention(tp: int, ep: int, c: Any) -> int:
    """SGLang's DP attention for an expert-parallel server whose KV heads are fewer than its tp ranks
    (plain TP would replicate them): attention runs tp / kv_heads ways data-parallel; MLA's latent KV cache is
    one head, so tp ways (SGLang's DeepSeek recipe: --enable-dp-attention --dp-size tp)."""
    if c is None or ep <= 1:
        return 1
    if getattr(c, "kv_lora_rank", None):  # MLA (DeepSeek-V3, Kimi-K2): one latent KV head, SGLang's --dp tp
        return tp
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return tp // kv if tp > kv and tp % kv == 0 else 1


def _check_model(alloc: Allocation, c: Any, dtype: str, gpu_gib: Optional[float], trainer: Any = None,
                 dp_attn: int = 1) -> list[str]:
    """The layout against the model, then (GPU jobs) memory: a server's weights per GPU, and every pipeline stage's
    peak on the trainer (state and activations, `fit.trainer_stage_fits`). Returns the fit's lines for the plan."""
    try:
        validate_for_model(alloc.train, c)
    except AllocationError as e:
        raise LaunchError(f"trainer part megatron:{alloc.train}: {str(e).removeprefix('AllocationError: ')}") from None
    inf = alloc.inference.strategy  # type: ignore[union-attr]
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if c.num_attention_heads % inf.tp:
        raise LaunchError(f"inference part: tp={inf.tp} does not divide num_attention_heads={c.num_attention_heads}")
    if inf.ep > 1 and (not experts or experts % inf.ep):
        raise LaunchError(f"inference part: ep={inf.ep} does not divide the model's num_experts={experts or 0}")
    if gpu_gib is None:
        return []
    p = fit.count_params(c)
    fp8 = fit.fp8_block_size(c) is not None
    srv = fit.server_gib_per_gpu(p, inf.tp, dtype, fp8=fp8, attention=fit.attention_params(c), dp_attention=dp_attn)
    if srv > fit.SERVER_WEIGHT_FRACTION * gpu_gib:
        kind = "FP8 " if fp8 else ""
        raise LaunchError(f"a server of {inf.tp} GPUs holds {srv:.1f} GiB of {kind}weights per GPU, over "
                          f"{fit.SERVER_WEIGHT_FRACTION:.0%} of a {gpu_gib:g} GiB GPU: raise the inference part's t")
    t = trainer if trainer is not None else TrainerConfig()
    mtp = 0 if t.mtp == "off" else None
    stages = fit.trainer_stage_fits(c, alloc.train, dtype, t.max_tokens_per_mb, t.recompute, t.recompute_modules,
                                    t.recompute_num_layers, mtp_layers=mtp)
    lines = [f"fit: a server GPU holds {srv:.1f} GiB of {'FP8 ' if fp8 else ''}weights "
             f"(<= {fit.SERVER_WEIGHT_FRACTION:.0%} of {gpu_gib:g} GiB); trainer per stage at "
             f"trainer.max_tokens_per_mb={t.max_tokens_per_mb}, trainer.recompute={t.recompute} "
             f"(<= {fit.TRAINER_FIT_FRACTION:.0%} of {gpu_gib:g} GiB = {fit.TRAINER_FIT_FRACTION * gpu_gib:.1f}):"]
    for st in stages:
        lines.append(f"fit: stage {st.stage} ({st.layers} layers, {st.in_flight} micro-batch(es) in flight): state "
                     f"{st.state_gib:.1f} + activations {st.activation_gib:.1f}"
                     + (f" + recomputed chunk {st.recompute_gib:.1f}" if st.recompute_gib else "")
                     + f" = {st.total_gib:.1f} GiB")
    worst = max(stages, key=lambda st: st.total_gib)
    if worst.total_gib > fit.TRAINER_FIT_FRACTION * gpu_gib:
        hint = ("trainer.recompute=selective or full, a smaller trainer.max_tokens_per_mb" if t.recompute == "none"
                else "trainer.recompute=full, a smaller trainer.max_tokens_per_mb" if t.recompute == "selective"
                else "a smaller trainer.max_tokens_per_mb")
        raise LaunchError(f"trainer megatron:{alloc.train}: pipeline stage {worst.stage} needs {worst.total_gib:.1f} GiB "
                          f"a GPU (state {worst.state_gib:.1f}, activations "
                          f"{worst.activation_gib + worst.recompute_gib:.1f}), over {fit.TRAINER_FIT_FRACTION:.0%} of "
                          f"a {gpu_gib:g} GiB GPU: {hint}, or more pipeline/expert parallelism or trainer nodes")
    return lines

