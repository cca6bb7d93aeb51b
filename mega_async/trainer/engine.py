"""Megatron train engine: packed 1-D micro-batches, pipeline-aware FFD, decoupled PPO (or, with
`loss="sft"`, plain cross-entropy on the loss-mask tokens: `mega-async sft`).

train_batch: [recompute or approximate prox logp] [reference logp when kl_coef > 0] -> split into
PPO mini-batches -> per mini-batch: FFD micro-batches (same count on every DP rank) -> Megatron
forward-backward schedule -> one optimizer step (distributed optimizer, grad clipping) -> LR schedule step.
Losses are token sums; Megatron divides gradients by the global token count (all micro-batches,
all DP ranks), so the objective is a global token mean whatever the split.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from mega_async.algo.loss import (LOG_W_BINS, approximate_proximal_logprobs, decoupled_ppo_loss,
                                  histogram_quantiles, kl_penalty, log_weight_histogram, sft_loss)
from mega_async.api.config import AlgorithmConfig, TrainerConfig
from mega_async.algo.packing import Packed, allocate_micro_batches, cp_partition_index, pack, seq_alignment
from mega_async.trainer.routing import RouteReplay
from mega_async.api.types import Version, WeightVersion

logger = logging.getLogger("mega_async.trainer.engine")

STAT_KEYS = ("loss", "n_tokens", "entropy", "staleness", "clip_frac", "imp_weight_capped_frac",
             "behav_imp_weight_mean", "approx_kl", "kl_ref", "lp_mismatch_sum", "lp_mismatch_n", "mtp_loss",
             "mtp_tokens")
# sums not divided by the token count (the MTP layers' loss is divided by their own trained positions)
_UNSCALED = ("n_tokens", "lp_mismatch_sum", "lp_mismatch_n", "mtp_loss", "mtp_tokens")


@dataclass
class EngineConfig:
    """What the trainer engine reads: the run's `trainer` and `algorithm` config sections themselves (not a
    mirror of their keys), the sampler's temperature (logprobs are scaled like the sampler's), and what only the
    SFT entry point (`loss`, `label_smoothing`) and the optimizer's defaults (`adam_eps`) set."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    temperature: float = 1.0
    adam_eps: float = 1e-8
    # ppo: the RL objective (algorithm section) | sft: cross-entropy of the loss-mask tokens (no proximal or
    # reference policy, advantages, behaviour logprobs or versions are read; mega_async.run.sft)
    loss: str = "ppo"
    label_smoothing: float = 0.0  # sft: weight of the uniform distribution over the vocabulary in the target

    @classmethod
    def from_run_config(cls, cfg: Any) -> "EngineConfig":
        return cls(cfg.trainer, cfg.algorithm, temperature=cfg.rollout.temperature or 1.0)

    @classmethod
    def of(cls, **kw: Any) -> "EngineConfig":
        """Flat keywords, each to the section that defines it: `EngineConfig.of(lr=0.05, prox_logp="behavior")`
        (tests, tools and the SFT entry point). An unknown key is a TypeError naming it."""
        own = {f.name for f in fields(cls)} - {"trainer", "algorithm"}
        t, a = {f.name for f in fields(TrainerConfig)}, {f.name for f in fields(AlgorithmConfig)}
        unknown = sorted(set(kw) - own - t - a)
        if unknown:
            raise TypeError(f"EngineConfig.of: unknown key(s) {unknown}; the engine's keys are the trainer and "
                            f"algorithm config sections' and {sorted(own)}")
        def pick(keys: set[str]) -> dict[str, Any]:
            return {k: v for k, v in kw.items() if k in keys}

        return cls(TrainerConfig(**pick(t)), AlgorithmConfig(**pick(a)), **pick(own))


@dataclass
class MicroBatch:
    packed: Packed
    labels: torch.Tensor  # [T] next token at each position
    loss_mask: torch.Tensor  # [T] 1 where the next token is a trained output token
    behav: torch.Tensor  # [T] behaviour logprob of the next token
    prox: Optional[torch.Tensor]
    ref: Optional[torch.Tensor]  # reference-policy logprob of the next token (kl_coef > 0)
    advantages: torch.Tensor  # [T]
    versions: torch.Tensor  # [T]
    rows: list[int]
    cp_index: Optional[torch.Tensor] = None  # with CP: this rank's positions of the stream (load-balanced chunks)
    routes: Optional[torch.Tensor] = None  # [T, layers, k] rollout experts of the forward at each position, -1: none

    def cp_local(self) -> "MicroBatch":
        """The per-token fields at this CP rank's positions (the whole micro-batch without CP)."""
        if self.cp_index is None:
            return self
        i = self.cp_index
        return MicroBatch(self.packed, self.labels[i], self.loss_mask[i], self.behav[i],
                          None if self.prox is None else self.prox[i], None if self.ref is None else self.ref[i],
                          self.advantages[i], self.versions[i], self.rows, i,
                          None if self.routes is None else self.routes[i])


class MegatronTrainEngine:
    def __init__(self, hf_dir: str, allocation: Any, cfg: EngineConfig, dtype: Optional[torch.dtype] = None,
                 version: Optional[Version] = None):
        from mega_async.trainer.cpu import apply_cpu_patches

        apply_cpu_patches()  # first: Megatron is imported with its CPU settings
        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from mega_async.trainer.model import build_model
        from mega_async.trainer.parallel import as_strategy

        strategy = as_strategy(allocation)
        if cfg.loss not in ("ppo", "sft"):
            raise ValueError(f"EngineConfig.loss={cfg.loss!r}: use ppo or sft")
        self.cfg = cfg
        on_gpu = torch.cuda.is_available()
        dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
        self.models = build_model(hf_dir, allocation, dtype=dtype, load_weights=True, mtp=cfg.trainer.mtp,
                                  recompute=cfg.trainer.recompute_options())
        self.bridge = self.models[0]._mega_async_bridge
        self.mtp_trains = self._setup_mtp(strategy)  # multi-token-prediction layers (mega_async.trainer.mtp)
        # the reference policy for the KL penalty: a frozen copy of the initial weights, same layout
        self.ref_models: list[torch.nn.Module] = []
        if cfg.algorithm.kl_coef > 0:
            self.ref_models = build_model(hf_dir, allocation, dtype=dtype, load_weights=True, mtp=cfg.trainer.mtp)
            for m in self.ref_models:
                m.eval()
                m.requires_grad_(False)
        ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
        self.ddp = [DistributedDataParallel(config=m.config, ddp_config=ddp_cfg, module=m) for m in self.models]
        t = cfg.trainer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
                            clip_grad=t.grad_clip, adam_eps=cfg.adam_eps, use_distributed_optimizer=True,
                            bf16=dtype is torch.bfloat16, params_dtype=dtype), self.ddp)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if t.warmup_steps else t.lr, max_lr=t.lr, min_lr=t.min_lr,
            lr_warmup_steps=t.warmup_steps, lr_decay_steps=max(t.total_steps, t.warmup_steps + 1),
            lr_decay_style=t.lr_decay, start_wd=t.weight_decay, end_wd=t.weight_decay,
            wd_incr_steps=max(t.total_steps, 1), wd_incr_style="constant")
        self.pp = mpu.get_pipeline_model_parallel_world_size()
        self.tp = mpu.get_tensor_model_parallel_world_size()
        if cfg.label_smoothing and (self.tp > 1 or cfg.loss != "sft"):
            raise ValueError(f"label_smoothing={cfg.label_smoothing} applies to loss=sft at tensor parallel size 1 "
                             f"(got loss={cfg.loss}, tp={self.tp})")
        self.cp = mpu.get_context_parallel_world_size()
        self._version = version if version is not None else WeightVersion()  # read; a run's sync writes it
        self._stats: dict[str, torch.Tensor] = {}
        self._measure = False  # the first mini-batch's forward (pre-update weights) measures train/rollout mismatch
        self._lp_mismatch_max = 0.0
        self._w_hist: Optional[torch.Tensor] = None  # behaviour-weight histogram of the step (last stage)
        self.routing: Optional[RouteReplay] = None
        if cfg.algorithm.routing_replay and not self.bridge.is_moe:
            raise ValueError("algorithm.routing_replay=true needs an MoE model; this one is dense")
        if self.bridge.is_moe:
            self.routing = RouteReplay(self.models, int(self.bridge.hf_config.num_hidden_layers),
                                       cfg.algorithm.routing_replay)

    def _setup_mtp(self, strategy: Any) -> bool:
        """Models with MTP layers: trainer.mtp=train returns their logits in training (their loss is added in
        `_loss`), freeze takes them out of training. Returns whether they train."""
        from mega_async.trainer import mtp
        from mega_async.trainer.parallel import AllocationError

        self.cfg.trainer.check_mtp(self.bridge.mtp_asked)  # the card's count: the built one may be 0 (off, none held)
        if not self.bridge.mtp_layers:
            return False
        if self.cfg.trainer.mtp == "freeze":
            logger.info("trainer.mtp=freeze: %d MTP parameters carried unchanged", mtp.freeze(self.models))
            return False
        if strategy.cp > 1:
            raise AllocationError(f"training the model's {self.bridge.mtp_layers} MTP layer(s) with context parallel "
                                  f"cp={strategy.cp} is not supported; use cp=1 or trainer.mtp=freeze")
        for m in self.models:
            m.mtp_logits = True
        return True

    def _loss(self, out: Any, mb: MicroBatch, loss_fn: Any) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The objective's loss from the main logits, plus mtp_loss_scaling_factor x the MTP layers' cross-entropy
        (a token sum) when they train; the MTP part is kept out of the objective's statistics."""
        from mega_async.trainer.mtp import mtp_loss_sum, split_output

        logits, mtp_logits = split_output(out)
        res = loss_fn(logits[0], mb)
        if not mtp_logits:
            return res
        loss, n, extra = res
        total, count = mtp_loss_sum([x[0] for x in mtp_logits], mb.labels, mb.loss_mask, mb.packed.cu_seqlens)
        with torch.no_grad():
            for k, v in (("mtp_loss", total), ("mtp_tokens", count)):
                self._stats[k] = self._stats.get(k, 0) + v.detach().float().cpu()
        return loss + self.cfg.trainer.mtp_loss_scaling_factor * total, n, extra

    # ---- batching ----------------------------------------------------------------------------
    def _rows(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Unpad [n, L] trajectory tensors into per-sequence 1-D tensors (labels shifted by one)."""
        n = batch["input_ids"].shape[0]
        adv = batch["advantages"]
        out = []
        for i in range(n):
            L = int(batch["attention_mask"][i].sum())
            ids = batch["input_ids"][i, :L]
            shift = lambda t, fill=0: torch.cat([t[i, 1:L], t.new_full((1,), fill)])  # noqa: E731
            a = adv[i] if adv.dim() == 1 else None
            out.append({
                "ids": ids, "labels": torch.cat([ids[1:], ids.new_zeros(1)]),
                "mask": shift(batch["loss_mask"]), "behav": shift(batch["logprobs"]),
                "versions": shift(batch["versions"], -1),
                "adv": (torch.full((L,), float(a)) if a is not None else shift(adv)).float(),
                "prox": shift(batch["prox_logprobs"]) if "prox_logprobs" in batch else None,
                "ref": shift(batch["ref_logprobs"]) if "ref_logprobs" in batch else None,
                # position t's route is the forward at t (which predicts t+1): no shift
                "routes": self._routes(batch["routed_experts"][i, :L]) if "routed_experts" in batch else None,
            })
        return out

    def _routes(self, r: torch.Tensor) -> torch.Tensor:
        """One sequence's routes as [L, layers, top_k] (trajectories carry [L, layers * top_k])."""
        k = int(self.bridge.hf_config.num_experts_per_tok)
        if r.dim() == 2 and r.shape[1] % k == 0:
            r = r.reshape(r.shape[0], -1, k)
        if r.dim() != 3 or r.shape[2] != k:
            raise ValueError(f"routed_experts rows of shape {tuple(r.shape[1:])} do not hold top-{k} experts per layer")
        return r

    def _micro_batches(self, rows: list[dict[str, torch.Tensor]], idx: list[int]) -> list[MicroBatch]:
        from megatron.core import parallel_state as mpu

        lengths = [rows[i]["ids"].numel() for i in idx]
        align = seq_alignment(self.tp, self.cp)
        padded = [-(-n // align) * align for n in lengths]
        count = torch.tensor(len(allocate_micro_batches(padded, self.cfg.trainer.max_tokens_per_mb, self.pp)))
        if dist.is_initialized():  # every DP rank runs the same number of micro-batches
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=mpu.get_data_parallel_group(with_context_parallel=True))
        groups = allocate_micro_batches(padded, self.cfg.trainer.max_tokens_per_mb, self.pp, min_count=int(count))
        mbs = []
        for g in groups:
            sel = [rows[idx[j]] for j in g]
            p = pack([r["ids"] for r in sel], align=align)

            def cat(key: str, fill: float = 0.0) -> torch.Tensor:
                parts = []
                for r, n, pl in zip(sel, p.lengths, p.padded_lengths):
                    parts.append(torch.nn.functional.pad(r[key].float() if key != "labels" else r[key], (0, pl - n),
                                                         value=fill))
                return torch.cat(parts)

            mbs.append(MicroBatch(p, cat("labels").long(), cat("mask"), cat("behav"),
                                  cat("prox") if sel[0]["prox"] is not None else None,
                                  cat("ref") if sel[0]["ref"] is not None else None, cat("adv"),
                                  cat("versions", -1).long(), [idx[j] for j in g], self._cp_index(p),
                                  _cat_routes(sel, p) if sel[0]["routes"] is not None else None))
        return mbs

    def _cp_index(self, p: Packed) -> Optional[torch.Tensor]:
        """This CP rank's stream positions: TE's own partitioning on GPU (its THD attention expects it), the
        same load-balanced layout computed here on CPU."""
        if self.cp == 1:
            return None
        from megatron.core import parallel_state as mpu

        rank = mpu.get_context_parallel_rank()
        if self.bridge.use_te:
            import transformer_engine_torch as tex  # GPU only

            cu = p.cu_seqlens.to(_device())
            return tex.thd_get_partitioned_indices(cu, p.tokens.numel(), self.cp, rank).long().cpu()
        return cp_partition_index(p.cu_seqlens, self.cp, rank)

    # ---- forward plumbing -------------------------------------------------------------------
    def _run(self, mbs: list[MicroBatch], loss_fn: Any, forward_only: bool,
             models: Optional[list[torch.nn.Module]] = None) -> list[Any]:
        from megatron.core.packed_seq_params import PackedSeqParams
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(it: Iterator[MicroBatch], model: torch.nn.Module) -> Any:
            mb = next(it)
            # cu_seqlens count whole sequences; with CP the model sees this rank's 1/cp of the stream
            cu = mb.packed.cu_seqlens.to(_device())
            psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                  max_seqlen_q=mb.packed.max_seqlen, max_seqlen_kv=mb.packed.max_seqlen)
            tokens, pos = mb.packed.tokens, mb.packed.position_ids
            if mb.cp_index is not None:
                tokens, pos = tokens[mb.cp_index], pos[mb.cp_index]
            local = mb.cp_local()
            routed = self.routing is not None and local.routes is not None
            if routed:  # replay targets and agreement counts for this chunk's routers
                w = local.loss_mask * (local.versions == self.version) if self._measure else None
                self.routing.before_forward(model, local.routes, w)
            out = model(tokens[None].to(_device()), pos[None].to(_device()), None, packed_seq_params=psp)
            if routed:
                self.routing.after_forward(model)
            return out, lambda out, non_loss_data=False, mb=local: self._loss(out, mb, loss_fn)

        max_t = max(mb.packed.tokens.numel() for mb in mbs) // self.cp
        models = models or (self.models if forward_only else self.ddp)
        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=[iter(mbs) for _ in models], model=models,
            num_microbatches=len(mbs), seq_length=max_t, micro_batch_size=1, forward_only=forward_only,
            collect_non_loss_data=forward_only)

    @torch.no_grad()
    def _logprobs(self, mbs: list[MicroBatch], models: Optional[list[torch.nn.Module]] = None) -> list[torch.Tensor]:
        """Per-position logprob of the next token for each micro-batch (broadcast from the last stage)."""
        from megatron.core import parallel_state as mpu

        from mega_async.trainer.logprobs import vocab_parallel_logprobs

        models = models or self.models
        modes = [m.training for m in models]
        for m in models:
            m.eval()
        outs = self._run(mbs, lambda logits, mb: vocab_parallel_logprobs(
            logits, mb.labels.to(_device()), self.cfg.temperature)[0].float().cpu(), forward_only=True, models=models)
        for m, mode in zip(models, modes):
            m.train(mode)
        res = []
        last = mpu.is_pipeline_last_stage(ignore_virtual=True)
        group = mpu.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(group, self.pp - 1) if self.pp > 1 else None
        for i, mb in enumerate(mbs):
            t = outs[i] if last else torch.empty(mb.packed.tokens.numel() // self.cp)
            if self.pp > 1:
                t = t.to(_device())
                dist.broadcast(t, src, group=group)
                t = t.cpu()
            res.append(self._cp_gather(t, mb))
        return res

    def _cp_gather(self, local: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """This CP rank's per-token values -> the whole stream's, gathered over the CP group (every rank's
        positions follow the load-balanced layout, which TE's partitioning shares)."""
        if mb.cp_index is None:
            return local
        from megatron.core import parallel_state as mpu

        group = mpu.get_context_parallel_group()
        parts = [torch.empty_like(local) for _ in range(self.cp)]
        dist.all_gather(parts, local.contiguous().to(_device()), group=group)
        out = torch.empty(mb.packed.tokens.numel(), dtype=local.dtype)
        for r, part in enumerate(parts):
            out[cp_partition_index(mb.packed.cu_seqlens, self.cp, r)] = part.cpu()
        return out

    def compute_logprobs(self, batch: dict[str, torch.Tensor], reference: bool = False) -> torch.Tensor:
        """Logprob of every token ([n, L], 0 on the first), without grad: the current policy (the proximal
        policy), or with `reference=True` the frozen reference policy of the KL penalty."""
        if reference and not self.ref_models:
            raise ValueError("no reference model: it is built only when kl_coef > 0 (algorithm.kl_coef)")
        rows = self._rows(batch)
        out = torch.zeros_like(batch["logprobs"], dtype=torch.float32)
        mbs = self._micro_batches(rows, list(range(len(rows))))
        for mb, lp in zip(mbs, self._logprobs(mbs, self.ref_models if reference else None)):
            starts = mb.packed.cu_seqlens[:-1].tolist()
            for r, s, n in zip(mb.rows, starts, mb.packed.lengths):
                out[r, 1:n] = lp[s:s + n - 1]  # position t predicts token t+1
        return out

    def routing_mismatch(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Per-layer top-1 / expert-set disagreement between this forward's routing (replayed when
        routing_replay is on) and the batch's `routed_experts`, on current-version output tokens; no update."""
        if self.routing is None or "routed_experts" not in batch:
            raise ValueError("routing_mismatch needs an MoE model and a batch with routed_experts")
        rows = self._rows(batch)
        self._measure = True
        try:
            self._logprobs(self._micro_batches(rows, list(range(len(rows)))))
        finally:
            self._measure = False
        return {k: v for k, v in self._mismatch_stats({}).items() if k.startswith("mismatch/route_")}

    # ---- training ----------------------------------------------------------------------------
    def train_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One PPO update on this DP rank's share of the batch (padded [n, L] trajectory tensors with
        `advantages` [n] or [n, L]); returns stats averaged over the global batch."""
        from megatron.core import parallel_state as mpu

        c, a, minibatches = self.cfg, self.cfg.algorithm, self.cfg.trainer.ppo_n_minibatches
        if a.routing_replay and "routed_experts" not in batch:
            raise ValueError("algorithm.routing_replay=true but the batch has no routed_experts: the servers must "
                             "return them (SGLang: --enable-return-routed-experts)")
        if a.prox_logp == "recompute" and c.loss == "ppo":
            batch = {**batch, "prox_logprobs": self.compute_logprobs(batch)}
        if a.kl_coef > 0 and c.loss == "ppo":
            batch = {**batch, "ref_logprobs": self.compute_logprobs(batch, reference=True)}
        rows = self._rows(batch)
        n = len(rows)
        if n < minibatches:
            raise ValueError(f"{n} sequences cannot form {minibatches} PPO mini-batches")
        acc: dict[str, torch.Tensor] = {}
        grad_norms = []
        for mini in range(minibatches):
            idx = list(range(mini, n, minibatches))
            mbs = self._micro_batches(rows, idx)
            for m in self.ddp:
                m.zero_grad_buffer()
            self.optimizer.zero_grad()
            self._measure = mini == 0
            try:
                self._run(mbs, self._sft_loss if c.loss == "sft" else self._ppo_loss, forward_only=False)
            finally:
                self._measure = False
            ok, grad_norm, _ = self.optimizer.step()
            if not ok:
                raise RuntimeError("optimizer step failed (non-finite gradients?)")
            self.scheduler.step(increment=1)
            grad_norms.append(float(grad_norm or 0.0))
            for k, v in self._stats.items():
                acc[k] = acc.get(k, 0) + v
            self._stats = {}
        # global sums over DP (the last pipeline stage holds them; broadcast over PP)
        keys = list(STAT_KEYS)  # only the last stage computed them; the others hold zeros until the broadcast
        hist = self._w_hist if self._w_hist is not None else torch.zeros(LOG_W_BINS, dtype=torch.float64)
        self._w_hist = None
        vec = torch.cat([torch.tensor([float(acc.get(k, 0.0)) for k in keys], dtype=torch.float64),
                         hist]).to(_device())  # the histogram travels with the sums
        if self.pp > 1:
            group = mpu.get_pipeline_model_parallel_group()
            dist.broadcast(vec, dist.get_global_rank(group, self.pp - 1), group=group)
        if dist.is_initialized():
            dist.all_reduce(vec, group=mpu.get_data_parallel_group(with_context_parallel=True))
        vec = vec.cpu()
        sums = dict(zip(keys, vec[:len(keys)].tolist()))
        quantiles = histogram_quantiles(vec[len(keys):]) if c.loss == "ppo" else {}
        tokens = max(sums.get("n_tokens", 0.0), 1.0)
        stats = {k: v / tokens for k, v in sums.items() if k not in _UNSCALED}
        stats.update(tokens=sums.get("n_tokens", 0.0), grad_norm=max(grad_norms), lr=self.optimizer.param_groups[0]["lr"])
        stats.update(self._mismatch_stats(sums))
        if self.mtp_trains:  # the MTP layers' own cross-entropy, apart from the policy loss and its statistics
            stats.update(mtp_loss=sums["mtp_loss"] / max(sums["mtp_tokens"], 1.0), mtp_tokens=sums["mtp_tokens"])
        stats.update({f"behav_w_p{round(q * 100):02d}": w for q, w in quantiles.items()})  # pi_prox / pi_behav
        return stats

    def _mismatch_stats(self, sums: dict[str, float]) -> dict[str, float]:
        """|trainer - behaviour| logprob over current-version tokens (mean, max) and, for MoE with routes, the
        per-layer fraction of those tokens whose top-1 expert (or expert set) differs from the rollout's."""
        peak = torch.tensor([self._lp_mismatch_max], dtype=torch.float64, device=_device())
        self._lp_mismatch_max = 0.0
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        n = sums.pop("lp_mismatch_n", 0.0)
        out = {"mismatch/current_tokens": n, "mismatch/logprob_abs_mean": sums.pop("lp_mismatch_sum", 0.0) / max(n, 1.0),
               "mismatch/logprob_abs_max": float(peak)}
        if self.routing is None:
            return out
        counts = self.routing.take_stats().to(_device())
        if dist.is_initialized():  # every (layer, token) is counted on exactly one rank: a world sum
            dist.all_reduce(counts)
        counts = counts.cpu()
        if counts[0].sum() == 0:
            return out
        total = counts.sum(1)
        out.update({"mismatch/route_top1_frac": float(total[1] / total[0]),
                    "mismatch/route_set_frac": float(total[2] / total[0])})
        for layer in self.routing.moe_layers:  # dense layers (DeepSeek's first_k_dense_replace) have no router
            tok = max(float(counts[0, layer]), 1.0)
            out[f"mismatch/route_top1_frac/layer{layer}"] = float(counts[1, layer]) / tok
            out[f"mismatch/route_set_frac/layer{layer}"] = float(counts[2, layer]) / tok
        return out

    def _ppo_loss(self, logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        from mega_async.trainer.logprobs import vocab_parallel_logprobs

        a = self.cfg.algorithm
        dev = logits.device
        logp, ent = vocab_parallel_logprobs(logits, mb.labels.to(dev), self.cfg.temperature, with_entropy=True)
        behav, mask = mb.behav.to(dev), mb.loss_mask.to(dev)
        if a.prox_logp in ("loglinear", "linear"):
            prox = approximate_proximal_logprobs(behav, logp, mb.versions.to(dev), self.version, a.prox_logp)
        elif a.prox_logp == "behavior":
            prox = behav
        else:
            prox = mb.prox.to(dev)
        loss, st = decoupled_ppo_loss(logp, prox, behav, mb.advantages.to(dev), mask, eps_clip=a.eps_clip,
                                      eps_clip_high=a.eps_clip_high, behav_imp_weight_cap=a.behav_imp_weight_cap,
                                      dual_clip=a.dual_clip, denominator=1.0,  # a token sum
                                      objective=a.objective, imp_weight_mode=a.imp_weight_mode,
                                      imp_weight_bounds=tuple(a.imp_weight_bounds), seq_ids=_seq_ids(mb, a, dev))
        n = mask.sum()
        kl_sum = torch.zeros((), device=dev)
        if a.kl_coef > 0:
            # outside the mask the reference is set equal to the policy: KL 0 there, and no inf x 0 from k3's exp
            ref = torch.where(mask.bool(), mb.ref.to(dev), logp.detach())
            kl_sum = (kl_penalty(logp, ref, a.kl_estimator) * mask).sum()
            loss = loss + a.kl_coef * kl_sum
        with torch.no_grad():
            contrib = {"loss": loss.detach(), "n_tokens": n, "entropy": (ent * mask).sum(), "kl_ref": kl_sum.detach(),
                       "staleness": ((self.version - mb.versions.to(dev)).clamp(min=0) * mask).sum(),
                       **{k: st[k] * n for k in ("clip_frac", "imp_weight_capped_frac", "behav_imp_weight_mean",
                                                 "approx_kl")}}
            if self._measure:  # tokens the current weights produced: their logprobs should agree
                cur = mask.bool() & (mb.versions.to(dev) == self.version)
                gap = (logp.detach() - behav).abs()[cur]
                contrib.update(lp_mismatch_sum=gap.sum(), lp_mismatch_n=cur.sum())
                if gap.numel():
                    self._lp_mismatch_max = max(self._lp_mismatch_max, float(gap.max()))
            for k, v in contrib.items():
                self._stats[k] = self._stats.get(k, 0) + v.detach().float().cpu()
            h = log_weight_histogram(prox - behav, mask)
            self._w_hist = h if self._w_hist is None else self._w_hist + h
        return loss, n.to(torch.int), {}

    def _sft_loss(self, logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Cross-entropy (a token sum, like the PPO loss) of the loss-mask tokens at temperature 1."""
        from mega_async.trainer.logprobs import vocab_parallel_logprobs

        dev = logits.device
        logp, ent = vocab_parallel_logprobs(logits, mb.labels.to(dev), 1.0, with_entropy=True)
        mask = mb.loss_mask.to(dev)
        eps = self.cfg.label_smoothing
        mean_lp = torch.log_softmax(logits.float(), -1).mean(-1) if eps else None  # tp 1 (checked at start)
        loss, _ = sft_loss(logp, mask, denominator=1.0, label_smoothing=eps, mean_logprobs=mean_lp)
        n = mask.sum()
        with torch.no_grad():
            for k, v in (("loss", loss), ("n_tokens", n), ("entropy", (ent * mask).sum())):
                self._stats[k] = self._stats.get(k, 0) + v.detach().float().cpu()
        return loss, n.to(torch.int), {}

    @property
    def version(self) -> int:
        """The weight version the next update trains from (tokens of this version are on-policy)."""
        return self._version.value

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from mega_async.trainer.weights import export_hf_weights

        return export_hf_weights(self.models)


def _cat_routes(rows: list[dict[str, torch.Tensor]], p: Packed) -> torch.Tensor:
    """The rows' routes on the packed stream [T, layers, k]; -1 on padding."""
    parts = [torch.nn.functional.pad(r["routes"].long(), (0, 0, 0, 0, 0, pl - n), value=-1)
             for r, n, pl in zip(rows, p.lengths, p.padded_lengths)]
    return torch.cat(parts)


def _seq_ids(mb: MicroBatch, a: AlgorithmConfig, dev: torch.device) -> Optional[torch.Tensor]:
    """Sequence index of every packed token, for the sequence-level objectives (gspo, seq_mask; CP is refused)."""
    if a.objective != "gspo" and a.imp_weight_mode != "seq_mask":
        return None
    pl = torch.tensor(mb.packed.padded_lengths)
    ids = torch.arange(len(pl)).repeat_interleave(pl)
    tail = mb.labels.numel() - ids.numel()  # stream padding after the last sequence (loss_mask 0 there)
    return torch.cat([ids, torch.full((tail,), len(pl), dtype=ids.dtype)]).to(dev)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # model.dtype


def build_engine(cfg: Any, layout: Any, version: Any = None) -> MegatronTrainEngine:
    """A run's trainer engine from its config (model.path and model.dtype, the trainer and algorithm sections) on
    the allocation's training layout; `version`: the sync's read-only view of the run's weight version."""
    return MegatronTrainEngine(cfg.model.path, layout, EngineConfig.from_run_config(cfg), dtype=DTYPES[cfg.model.dtype],
                               version=version)
