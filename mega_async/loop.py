"""Drivers.

run_training (the RL loop, SPMD on every trainer rank; global rank 0, the DP head, also owns the
servers, the rollout executor and the metrics):

    prepare_batch -> advantages + token-balanced DP shares -> train_batch -> sync.push -> metrics.log

run_rollout: the rollout layer alone: prepare_batch -> stats -> the servers reload the model card at
each version (exercises interruption and the update path without a trainer).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter
from typing import Any, Callable, Optional

import torch

from mega_async.config import ConfigError, RunConfig, api_key, save_config
from mega_async.data import check_items, load_rows, synthetic_items
from mega_async.evaluation import Evaluator
from mega_async.events import EventLog, NullEventLog
from mega_async.inference.service import InferenceService
from mega_async.metrics import Metrics, RewardTracker, prefixed
from mega_async.rollout.executor import WorkflowExecutor
from mega_async.rollout.filters import DynamicFilter
from mega_async.rollout.workflow import GroupWorkflow, make_workflow
from mega_async.types import WeightVersion

logger = logging.getLogger("mega_async.loop")


def build_dataset(cfg: RunConfig, vocab_size: int) -> list[dict[str, Any]]:
    d = cfg.data
    if d.name == "synthetic":
        return synthetic_items(1024, vocab_size, seed=cfg.seed, target=d.synthetic_target)
    if d.name == "gsm8k":  # a local file or directory, else the dataset name (datasets); eval rows held out
        from mega_async.data.gsm8k import load_gsm8k

        return load_gsm8k(d.path, d.split, eval_path=d.eval_path, eval_split=d.eval_split, chat=d.chat_template,
                          eval_size=d.eval_size if cfg.trainer.eval_interval else 0).train
    rows = load_rows(d.path)  # type: ignore[arg-type]
    if cfg.rollout.workflow in ("rlvr", "multi_turn"):  # a user's workflow reads its own row shape
        check_items(rows, str(d.path), vocab_size)
    return rows


def check_inputs(cfg: RunConfig) -> None:
    """Before anything starts (no run directory yet): the model card exists, prompt + generation budget fits its
    context, the dataset is there and parses, the reward function loads. Raises ConfigError (one line)."""
    from pathlib import Path

    if cfg.inference.backend == "sglang" and not cfg.inference.addresses:  # we launch them: a tested release
        from mega_async.inference.launch import untested_sglang

        if problem := untested_sglang(cfg.inference.allow_untested_sglang):
            raise ConfigError(problem)
    card = Path(cfg.model.path) / "config.json"
    if not card.is_file():
        raise ConfigError(f"model.path={cfg.model.path}: config.json not found; pass an HF-format model directory")
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(cfg.model.path)
    from mega_async.bridge.families import UnsupportedModelError, check_model

    try:  # what the trainer cannot build faithfully (e.g. DeepSeek's MTP layers) is refused before anything starts
        check_model(hf)
    except UnsupportedModelError as e:
        raise ConfigError(f"model.path={cfg.model.path}: {e}") from None
    ctx = getattr(hf, "max_position_embeddings", None)
    budget = cfg.rollout.max_new_tokens + cfg.data.max_prompt_tokens
    if ctx is not None and budget > ctx:
        raise ConfigError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} + data.max_prompt_tokens="
                          f"{cfg.data.max_prompt_tokens} = {budget} exceeds the model's context "
                          f"max_position_embeddings={ctx} ({card}); lower one of them")
    try:
        items = build_dataset(cfg, getattr(hf, "vocab_size", 64))
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise ConfigError(f"data.path={cfg.data.path}: {type(e).__name__}: {' '.join(str(e).split())}") from None
    if not items:
        raise ConfigError(f"data.path={cfg.data.path}: the dataset is empty")
    reward_for(cfg)


def reward_for(cfg: RunConfig) -> Callable[..., float]:
    """The reward function `data.reward` names (or the dataset's own: synthetic, gsm8k)."""
    name = cfg.data.reward or cfg.data.name
    if name == "gsm8k":
        from mega_async.reward.gsm8k import gsm8k_reward

        return gsm8k_reward
    if name == "code":
        from mega_async.reward.code import SandboxUnavailable, check_sandbox, code_reward

        try:
            check_sandbox()  # once per process: refuse at start-up, not a run that rejects every sample
        except SandboxUnavailable as e:
            raise ConfigError(f"data.reward=code: {e}") from None
        return code_reward
    if name == "synthetic":
        from mega_async.reward.synthetic import target_token_reward

        return target_token_reward
    import importlib

    module, _, fn = name.partition(":")
    try:
        return getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"data.reward={name!r}: cannot load it ({type(e).__name__}: {e})") from None


def rollout_parts(cfg: RunConfig, service: InferenceService) -> tuple[list, GroupWorkflow, DynamicFilter | None]:
    """Dataset, GRPO group workflow and dynamic filter for a run (shared by both drivers)."""
    r = cfg.rollout
    workflow = GroupWorkflow(make_workflow(cfg, service.tokenizer, reward_for(cfg)), r.group_size)  # rollout.workflow
    flt = DynamicFilter(max_consecutive_drops=r.dynamic_filter_max_drops) if r.dynamic_filter else None
    return within_prompt_budget(build_dataset(cfg, service.vocab_size), workflow.workflow, cfg), workflow, flt


def within_prompt_budget(items: list, workflow: Any, cfg: RunConfig) -> list:
    """Drop items whose prompt exceeds `data.max_prompt_tokens` (counted and logged), so every episode fits the
    model's context with `rollout.max_new_tokens` (checked at load)."""
    limit = cfg.data.max_prompt_tokens
    encode = getattr(workflow, "encode", None)
    if encode is None:
        return items
    kept = [it for it in items if len(encode(it)[0]) <= limit]
    if len(kept) < len(items):
        logger.warning("skipped %d of %d prompts longer than data.max_prompt_tokens=%d", len(items) - len(kept),
                       len(items), limit)
    if not kept:
        raise ConfigError(f"every prompt is longer than data.max_prompt_tokens={limit}; raise it")
    return kept


# ---- rollout only ----------------------------------------------------------------------------------
def run_rollout(cfg: RunConfig) -> list[dict[str, float]]:
    """Run `trainer.total_steps` rollout steps with weight-version bumps; returns per-step stats."""
    from mega_async.trainer.sync import ReloadWeightSync, RolloutSide

    version = WeightVersion()
    events = EventLog(cfg.run_dir / "events.jsonl")  # the timeline; written from the first event on
    service = InferenceService(cfg, version, events=events)  # a bad model.path fails here, before the run dir
    metrics = None
    try:
        save_config(cfg, cfg.run_dir)
        metrics = Metrics(cfg.run_dir, tensorboard=cfg.logging.tensorboard)
        data, workflow, flt = rollout_parts(cfg, service)
        with WorkflowExecutor.from_config(cfg.rollout, service.engine, workflow, should_accept=flt,
                                          version=version, events=events) as ex:
            sync = ReloadWeightSync(version, RolloutSide(service.engine, ex), cfg.model.path,
                                    timeout=cfg.trainer.sync_timeout, events=events, interrupt=cfg.rollout.interrupt)
            try:
                for step in range(cfg.trainer.total_steps):
                    batch = ex.prepare_batch(data)
                    stat = metrics.log(step, _rollout_stats(step, batch, ex, flt))
                    logger.info("step %d: %d groups, %d tokens, reward %.3f, max head staleness %d", step,
                                stat["groups"], stat["output_tokens"], stat["reward_mean"], stat["head_staleness_max"])
                    with events.span("sync", phase="push", step=step):
                        sync.push()
            finally:
                sync.close()
        return metrics.history
    finally:
        if metrics is not None:
            metrics.close()
        service.close()
        events.close()


def _rollout_stats(step: int, batch: list[dict], ex: WorkflowExecutor, flt: Optional[DynamicFilter]) -> dict:
    heads = [int(g["versions"][g["loss_mask"].bool()].min()) for g in batch if g["loss_mask"].any()]
    rewards = torch.cat([g["rewards"] for g in batch])
    return {"groups": len(batch), "sequences": int(rewards.numel()),
            "output_tokens": sum(int(g["loss_mask"].sum()) for g in batch), "reward_mean": float(rewards.mean()),
            "head_staleness_max": max((step - h for h in heads), default=0),
            **{f"staleness_{k}": v for k, v in sorted(Counter(step - h for h in heads).items())},
            **prefixed("executor", ex.stats), **prefixed("filter", flt.stats if flt else None)}


# ---- training --------------------------------------------------------------------------------------
class Preempted(Exception):
    """The run stopped at a step boundary on request (Slurm's pre-emption signal) after writing a checkpoint."""

    def __init__(self, step: int, checkpoint: Any):
        super().__init__(f"preempted after step {step}; checkpoint {checkpoint}; continue with --resume")
        self.step, self.checkpoint = step, checkpoint


class RolloutOwner:
    """Rank 0's half of a run: servers, dataset order, executor, ledger, metrics and evaluation."""

    def __init__(self, cfg: RunConfig, version: WeightVersion, stack: contextlib.ExitStack, start: int, cpu: bool,
                 events: Any = None):
        from mega_async.rollout.dataloader import EpochLoader
        from mega_async.rollout.ledger import Ledger

        self.cfg = cfg
        self.events = events if events is not None else NullEventLog()
        self.service = InferenceService(cfg, version, weights_root=(cfg.run_dir / "weights"),
                                        cpu_share=0.5 if cpu else 1.0, events=events)
        stack.callback(self.service.close)
        self.metrics = Metrics(cfg.run_dir, tensorboard=cfg.logging.tensorboard, purge_step=start or None)
        stack.callback(self.metrics.close)
        self.ledger = Ledger(cfg.run_dir / "rollouts.jsonl")
        stack.callback(self.ledger.close)
        data, workflow, self.flt = rollout_parts(cfg, self.service)
        self.loader = EpochLoader(data, seed=cfg.seed, shuffle=cfg.data.shuffle)
        self.ex = stack.enter_context(WorkflowExecutor.from_config(cfg.rollout, self.service.engine, workflow,
                                                                   should_accept=self.flt, version=version,
                                                                   ledger=self.ledger, events=events))
        self.rewards = RewardTracker(self.flt)
        self.evaluator = Evaluator.from_config(cfg, self.service, reward_for(cfg))

    def snapshot(self, sync: Any) -> tuple[dict, dict]:
        """Under the pause bracket (nothing generates): every unconsumed rollout, the dataset position, the
        filter and reward counters, and the sizes of metrics, ledger and timeline. Returns (rollout state,
        trainer.json extras)."""
        with sync.pause_bracket():
            settle = getattr(self.service.engine, "settle", None)
            held = settle(self.cfg.trainer.sync_timeout) if settle else 0  # aborted requests' outputs arrive
            if held:
                logger.info("checkpoint: %d requests still in flight after settling (normally sent as the pause "
                            "began, queued by the paused servers with no new tokens); their episodes are saved up "
                            "to their last received token and continue from there", held)
            state = {"executor": self.ex.snapshot(), "loader": self.loader.state_dict(),
                     "rewards": self.rewards.state_dict()}
            sizes = {"ledger_bytes": self.ledger.size(), "metrics_bytes": self.metrics.size()}
            if isinstance(self.events, EventLog):  # no timeline: nothing to cut back on resume
                sizes["events_bytes"] = self.events.size()
        return state, sizes

    def restore(self, state: dict, version: int) -> None:
        self.loader.load_state_dict(state["loader"])
        if "rewards" in state:
            self.rewards.load_state_dict(state["rewards"])
        self.ex.on_version_recovered(version)  # the staleness budget: version * B groups were consumed
        self.ex.restore(state["executor"])
        logger.info("resumed at version %d: %d rollouts restored (%d running, %d ready), dataset epoch %d "
                    "position %d", version, len(state["executor"]["episodes"]),
                    sum(e["state"] == "running" for e in state["executor"]["episodes"]),
                    sum(e["state"] == "done" for e in state["executor"]["episodes"]), state["loader"]["epoch"],
                    state["loader"]["position"])


def run_training(cfg: RunConfig, stop_requested: Optional[Callable[[], bool]] = None,
                 resume_checked: bool = False) -> list[dict[str, float]]:
    """The RL loop on this trainer rank (all ranks run it; rank 0 returns the per-step history). Continues from
    a checkpoint per `trainer.resume` (checked whole first, unless the caller did: `resume_checked`);
    `stop_requested()` true on any rank: checkpoint, then raise Preempted."""
    import torch.distributed as dist

    from mega_async.allocation import parse_allocation
    from mega_async.checkpoint import checked_resume_point, load_checkpoint, reset_run_dir, resume_point
    from mega_async.trainer.engine import EngineConfig, MegatronTrainEngine
    from mega_async.trainer.parallel import control_group, destroy_parallel_state, init_distributed
    from mega_async.trainer.sync import from_rank0
    from mega_async.trainer.weights import save_hf_checkpoint

    alloc = parse_allocation(cfg.parallel.allocation)
    init_distributed()
    ctrl = control_group()  # batches and failure agreement: gloo, with a timeout longer than any rollout wait
    rank0 = dist.get_rank() == 0
    resume = None
    if rank0:
        _weights_ready(cfg)  # a bad model.path fails here, before the run directory is written
        resume = resume_point(cfg.run_dir, cfg.trainer.resume) if resume_checked else \
            checked_resume_point(cfg, alloc.train.world_size)  # the whole checkpoint, before anything starts
        reset_run_dir(cfg.run_dir, resume)
        save_config(cfg, cfg.run_dir)
    resume = from_rank0(resume, ctrl)
    events = EventLog(cfg.run_dir / "events.jsonl", rank=dist.get_rank())  # every rank appends to the timeline
    cpu = not torch.cuda.is_available()
    if cpu:  # trainer ranks and servers share the host's cores: split them, never oversubscribe
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (2 * alloc.train.world_size)))
    engine = MegatronTrainEngine(cfg.model.path, alloc.train, EngineConfig.from_run_config(cfg),
                                 dtype=_DTYPES[cfg.model.dtype])
    meta = load_checkpoint(resume, engine) if resume is not None else None
    start = meta["step"] + 1 if meta else 0
    version = WeightVersion(meta["version"] - 1 if meta else 0)  # a resume's first push brings it back
    owner = None
    with contextlib.ExitStack() as stack:
        stack.callback(events.close)
        if rank0:
            owner = RolloutOwner(cfg, version, stack, start, cpu, events)
        sync = make_sync(cfg, engine, version, owner.service if owner else None, owner.ex if owner else None, ctrl,
                         events)
        stack.callback(sync.close)
        if meta:
            sync.push()  # the servers get the checkpoint's weights at its version before any rollout resumes
            if owner is not None:
                owner.restore(meta["rollout"], version.value)
        engine.set_version(version.value)
        preempt = False
        for step in range(start, cfg.trainer.total_steps):
            _train_step(step, cfg, engine, sync, version, owner, ctrl, events)
            preempt = _any_rank(bool(stop_requested and stop_requested()), ctrl)
            last = step == cfg.trainer.total_steps - 1
            if preempt or last or (cfg.trainer.save_interval and (step + 1) % cfg.trainer.save_interval == 0):
                path = _save(step, cfg, engine, sync, version, owner)
            if preempt:
                break
        else:
            save_hf_checkpoint(engine.models, cfg.run_dir / "final_hf", src_dir=cfg.model.path)
    destroy_parallel_state()  # every rank got here: leave together
    if preempt:
        raise Preempted(step, path)
    return owner.metrics.history if owner is not None else []


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _train_step(step: int, cfg: RunConfig, engine: Any, sync: Any, version: WeightVersion,
                owner: Optional[RolloutOwner], ctrl: Any, events: Any = None) -> None:
    """prepare_batch -> DP shares -> train_batch -> sync.push -> metrics (rank 0)."""
    events = events if events is not None else NullEventLog()
    t0 = time.monotonic()
    groups = owner.ex.prepare_batch(owner.loader) if owner is not None else None
    t_rollout = time.monotonic() - t0
    batch, batch_reward = dp_share(groups, cfg, ctrl)
    with events.span("train_step", step=step):
        train_stats = engine.train_batch(batch)
    t_train = time.monotonic() - t0 - t_rollout
    with events.span("sync", phase="push", step=step):
        sync_stats = sync.push()
    engine.set_version(version.value)
    if owner is None:
        return
    ex, flt = owner.ex, owner.flt
    stat = owner.metrics.log(step, {
        "version": version.value, "reward_mean": owner.rewards.since_last(batch_reward),
        "batch_reward_mean": batch_reward, "rollout_wait_s": round(t_rollout, 3),
        "train_s": round(t_train, 3), "step_s": round(time.monotonic() - t0, 3),
        **prefixed("train", train_stats), **sync_stats, **prefixed("executor", ex.stats),
        **prefixed("filter", flt.stats if flt else None),
        **(owner.evaluator.maybe_evaluate(step) if owner.evaluator else {})})
    logger.info("step %d: reward %.3f, loss %.4f, %d tokens, grad norm %.3f, staleness %.2f, %.1fs", step,
                stat["reward_mean"], train_stats.get("loss", 0.0), train_stats.get("tokens", 0),
                train_stats.get("grad_norm", 0.0), train_stats.get("staleness", 0.0), stat["step_s"],
                extra={"progress_step": step})  # advances the console's progress bar


def _save(step: int, cfg: RunConfig, engine: Any, sync: Any, version: WeightVersion,
          owner: Optional[RolloutOwner]) -> Any:
    from mega_async.checkpoint import save_checkpoint
    from mega_async.checkpoint_check import run_record

    t0 = time.monotonic()
    state, sizes = owner.snapshot(sync) if owner is not None else (None, {})
    path = save_checkpoint(cfg.run_dir, step, engine, version.value, cfg.parallel.allocation, state,
                           keep=cfg.trainer.keep_checkpoints, extra={**sizes, **run_record(cfg)})
    logger.info("checkpoint %s (%.1fs)", path, time.monotonic() - t0)
    return path


def _any_rank(flag: bool, group: Any) -> bool:
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def dp_share(groups: Optional[list[dict]], cfg: RunConfig, group: Any = None) -> tuple[dict[str, torch.Tensor], float]:
    """Rank 0's groups get advantages and are split over DP ranks by tokens (whole groups); every rank
    receives the batch and keeps its share (TP/PP/CP peers of a DP rank keep the same share)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from mega_async.algo.advantages import batch_with_advantages
    from mega_async.packing import redistribute_groups
    from mega_async.types import concat_padded

    payload = None
    if groups is not None:
        a = cfg.algorithm
        groups, rewards = batch_with_advantages(groups, a.adv_norm, a.reward_scale, a.reward_bias)
        tokens = [int(g["attention_mask"].sum()) for g in groups]
        payload = (groups, redistribute_groups(tokens, mpu.get_data_parallel_world_size()), float(rewards.mean()))
    if dist.get_world_size() > 1:
        box = [payload]
        dist.broadcast_object_list(box, src=0, group=group)
        payload = box[0]
    groups, shares, reward = payload
    return concat_padded([groups[i] for i in shares[mpu.get_data_parallel_rank()]]), reward


def make_sync(cfg: RunConfig, engine: Any, version: WeightVersion, service: Optional[InferenceService],
              executor: Optional[WorkflowExecutor], group: Any = None, events: Any = None) -> Any:
    """The weight sync of `trainer.weight_sync` (rank 0 passes the servers and the executor)."""
    import torch.distributed as dist

    from mega_async.trainer.sync import DiskWeightSync, DistributedWeightSync, RolloutSide

    t = cfg.trainer
    rollout = RolloutSide(service.engine, executor) if service is not None else None
    kw = dict(timeout=t.sync_timeout, verify=engine.compute_logprobs if t.verify_sync else None,
              verify_tol=t.verify_sync_tol, temperature=cfg.rollout.temperature or 1.0, group=group, events=events,
              verify_method=t.verify_sync_method, interrupt=cfg.rollout.interrupt, weight_format=t.sync_weight_format)
    if t.weight_sync == "disk":
        return DiskWeightSync(engine.models, version, rollout, cfg.run_dir / "weights", src_dir=cfg.model.path,
                              keep=t.keep_weight_versions, **kw)
    box = [(service.addresses, service.gpus_per_server) if service is not None else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0, group=group)
    addresses, gpus = box[0]
    return DistributedWeightSync(engine.models, version, rollout, addresses, api_key=api_key(cfg),
                                 bucket_bytes=t.sync_bucket_bytes, load_format=t.sync_load_format,
                                 backend=t.sync_backend, gpus_per_server=gpus,
                                 master_address=t.sync_master_address, **kw)


def _weights_ready(cfg: RunConfig) -> None:
    from mega_async.model_cards import has_weights, init_random_weights

    if not has_weights(cfg.model.path):
        logger.info("%s has no weights yet: writing a deterministic random init (seed %d)", cfg.model.path, cfg.seed)
        init_random_weights(cfg.model.path, seed=cfg.seed)
