"""Drivers.

run_training (the RL loop): prepare_batch -> advantages -> train_batch (Megatron) -> export HF
weights to the run directory -> pause rollout -> servers load them -> version += 1 -> resume.
run_rollout: the rollout layer alone: prepare_batch -> stats -> the same weight step, reloading
the model card (exercises interruption and the update path without a trainer).
"""
from __future__ import annotations

import asyncio
import json
import os
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

from mega_async.config import ConfigError, RunConfig, save_config
from mega_async.data import gsm8k_items, load_rows, synthetic_items
from mega_async.rollout.executor import WorkflowExecutor
from mega_async.rollout.filters import DynamicFilter
from mega_async.rollout.workflow import GroupWorkflow, RLVRWorkflow

logger = logging.getLogger("mega_async.loop")


def build_dataset(cfg: RunConfig, vocab_size: int) -> list[dict[str, Any]]:
    d = cfg.data
    if d.name == "synthetic":
        return synthetic_items(1024, vocab_size, seed=cfg.seed, target=d.synthetic_target)
    if d.name == "gsm8k":
        if not d.path:
            raise ValueError("data.name=gsm8k needs data.path (a GSM8K jsonl file or a directory with train.jsonl)")
        return gsm8k_items(d.path, d.split)
    return load_rows(d.path)  # type: ignore[arg-type]


def reward_for(cfg: RunConfig) -> Callable[..., float]:
    if cfg.data.name == "gsm8k":
        from mega_async.reward.gsm8k import gsm8k_reward

        return gsm8k_reward
    from mega_async.reward.synthetic import target_token_reward

    return target_token_reward


class RolloutBackend:
    """The engine the rollout layer talks to, plus what the driver needs around it.

    embedded: launch `inference.num_servers` embedded servers (random-init weights are made for a
    model card that has none) and drive them with the SGLang client; sglang: connect to
    `inference.addresses`, or launch real SGLang servers; simulated: the latency simulator.
    """

    def __init__(self, cfg: RunConfig, weights_root: Any = None, cpu_share: float = 1.0):
        self.cfg = cfg
        self.launcher: Any = None
        self.tokenizer: Any = None
        self.vocab_size = 64
        inf = cfg.inference
        if inf.backend == "simulated":
            from mega_async.inference.simulated import SimulatedEngine

            self.engine: Any = SimulatedEngine(vocab_size=self.vocab_size, token_latency=(0.0, 0.002), seed=cfg.seed)
            return
        from transformers import AutoConfig, AutoTokenizer

        from mega_async.inference.client import SGLangClient
        from mega_async.inference.launch import ServerLauncher, ServerSpec
        from mega_async.model_cards import has_weights, init_random_weights

        model = cfg.model.path
        if inf.backend == "embedded" and not has_weights(model):
            logger.info("%s has no weights yet: writing a deterministic random init (seed %d)", model, cfg.seed)
            init_random_weights(model, seed=cfg.seed)
        self.vocab_size = AutoConfig.from_pretrained(model).vocab_size
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        addresses = list(inf.addresses)
        if not addresses:
            spec = ServerSpec(inf.backend, model, num_servers=inf.num_servers, api_key=inf.api_key,
                              dtype=cfg.model.dtype, seed=cfg.seed, extra_args=inf.extra_args,
                              weights_root=str(weights_root) if weights_root else None,
                              num_threads=max(1, int((os.cpu_count() or 1) * cpu_share) // inf.num_servers))
            self.launcher = ServerLauncher(spec, log_dir=str(cfg.run_dir / "server_logs"))
            addresses = self.launcher.start()
        self.engine = SGLangClient(addresses, api_key=inf.api_key, request_timeout=inf.request_timeout)

    def weight_step(self, version: int, path: Any = None) -> None:
        """pause -> servers load the HF directory `path` (default: the model card again) -> version ->
        continue; the simulator just interrupts."""
        if self.cfg.inference.backend == "simulated":
            self.engine.pause_generation()
            try:
                self.engine.set_version(version)
            finally:
                self.engine.continue_generation()
            return
        client = self.engine
        path = str(Path(path or self.cfg.model.path).resolve())
        asyncio.run(client.update_weights(lambda: client.update_weights_from_disk(path, version), version))

    def close(self) -> None:
        if self.launcher is not None:
            self.launcher.stop()


def run_rollout(cfg: RunConfig) -> list[dict[str, float]]:
    """Run `trainer.total_steps` rollout steps with weight-version bumps; returns per-step stats."""
    backend = RolloutBackend(cfg)  # a bad model.path fails here, before the run directory is written
    try:
        save_config(cfg, cfg.run_dir)
        return _rollout_steps(cfg, backend)
    finally:
        backend.close()


def rollout_parts(cfg: RunConfig, backend: RolloutBackend) -> tuple[list, GroupWorkflow, DynamicFilter | None]:
    """Dataset, GRPO group workflow and dynamic filter for a run (shared by both drivers)."""
    r = cfg.rollout
    workflow = GroupWorkflow(
        RLVRWorkflow(reward_for(cfg), tokenizer=backend.tokenizer, max_new_tokens=r.max_new_tokens,
                     temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, reward_timeout=r.reward_timeout),
        r.group_size,
    )
    flt = DynamicFilter(max_consecutive_drops=r.dynamic_filter_max_drops) if r.dynamic_filter else None
    return build_dataset(cfg, backend.vocab_size), workflow, flt


def _rollout_steps(cfg: RunConfig, backend: RolloutBackend) -> list[dict[str, float]]:
    run_dir, r = cfg.run_dir, cfg.rollout
    data, workflow, flt = rollout_parts(cfg, backend)
    history = []
    metrics_path = run_dir / "metrics.jsonl"
    with WorkflowExecutor.from_config(r, backend.engine, workflow, should_accept=flt) as ex, \
            metrics_path.open("a") as mf:
        t0 = time.monotonic()
        for step in range(cfg.trainer.total_steps):
            batch = ex.prepare_batch(data)
            heads = [int(g["versions"][g["loss_mask"].bool()].min()) for g in batch if g["loss_mask"].any()]
            rewards = torch.cat([g["rewards"] for g in batch])
            n_tok = sum(int(g["loss_mask"].sum()) for g in batch)
            stat = {
                "step": step,
                "groups": len(batch),
                "sequences": int(rewards.numel()),
                "output_tokens": n_tok,
                "reward_mean": float(rewards.mean()),
                "head_staleness_max": max((step - h for h in heads), default=0),
                "elapsed_s": round(time.monotonic() - t0, 3),
                **{f"staleness_{k}": v for k, v in sorted(Counter(step - h for h in heads).items())},
                **{f"executor/{k}": v for k, v in ex.stats.items()},
                **({f"filter/{k}": v for k, v in flt.stats.items()} if flt else {}),
            }
            history.append(stat)
            mf.write(json.dumps(stat) + "\n")
            mf.flush()
            logger.info(
                "step %d: %d groups, %d tokens, reward %.3f, max head staleness %d",
                step, len(batch), n_tok, stat["reward_mean"], stat["head_staleness_max"],
            )
            # weight step (no trainer yet): executor pause -> servers pause -> weights -> version -> resume
            ex.pause()
            try:
                backend.weight_step(step + 1)
                ex.set_version(step + 1)
            finally:
                ex.resume()
    return history


def _weights_ready(cfg: RunConfig) -> None:
    from mega_async.model_cards import has_weights, init_random_weights

    if not has_weights(cfg.model.path):
        logger.info("%s has no weights yet: writing a deterministic random init (seed %d)", cfg.model.path, cfg.seed)
        init_random_weights(cfg.model.path, seed=cfg.seed)


def run_training(cfg: RunConfig) -> list[dict[str, float]]:
    """The RL loop on one trainer process (rank 0 also owns the rollout executor)."""
    import shutil

    from torch.utils.tensorboard import SummaryWriter

    from mega_async.algo.advantages import grpo_advantages
    from mega_async.bridge import save_hf_checkpoint
    from mega_async.trainer.engine import EngineConfig, MegatronTrainEngine
    from mega_async.trainer.parallel import destroy_parallel_state, parse_allocation
    from mega_async.types import concat_padded

    alloc = parse_allocation(cfg.parallel.allocation)
    if alloc.train.world_size != 1:
        raise ConfigError(f"parallel.allocation={cfg.parallel.allocation}: this driver runs one trainer rank "
                          "(megatron:d1); multi-rank training runs through the engine under torchrun")
    _weights_ready(cfg)  # a bad model.path fails here, before the run directory is written
    run_dir = cfg.run_dir
    save_config(cfg, run_dir)
    weights_dir = (run_dir / "weights").resolve()
    weights_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():  # trainer and servers share the host's cores: split them, never oversubscribe
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    engine = MegatronTrainEngine(cfg.model.path, alloc.train, EngineConfig.from_run_config(cfg))
    backend = RolloutBackend(cfg, weights_root=weights_dir, cpu_share=0.5 if not torch.cuda.is_available() else 1.0)
    a, r = cfg.algorithm, cfg.rollout
    writer = SummaryWriter(str(run_dir / "tensorboard")) if cfg.logging.tensorboard else None
    history: list[dict[str, float]] = []
    try:
        data, workflow, flt = rollout_parts(cfg, backend)
        seen = (0.0, 0)  # filter's running reward sum and count at the previous step
        t0 = time.monotonic()
        with WorkflowExecutor.from_config(r, backend.engine, workflow, should_accept=flt) as ex, \
                (run_dir / "metrics.jsonl").open("a") as mf:
            for step in range(cfg.trainer.total_steps):
                t_step = time.monotonic()
                groups = ex.prepare_batch(data)
                t_rollout = time.monotonic() - t_step
                for g in groups:  # group-wise advantages (groups may have lost rejected members)
                    method = a.adv_norm if a.adv_norm != "batch" else "none"
                    g["advantages"] = grpo_advantages(g["rewards"], g["rewards"].numel(), method,
                                                      reward_scale=a.reward_scale, reward_bias=a.reward_bias)
                batch = concat_padded(groups)
                if a.adv_norm == "batch":
                    batch["advantages"] = grpo_advantages(batch["rewards"], 1, "batch", reward_scale=a.reward_scale,
                                                          reward_bias=a.reward_bias)
                train_stats = engine.train_batch(batch)
                # weight step: export -> servers load it -> version += 1
                version = step + 1
                path = weights_dir / f"v{version}"
                save_hf_checkpoint(engine.models, path, src_dir=cfg.model.path)
                ex.pause()
                try:
                    backend.weight_step(version, path)
                    ex.set_version(version)
                finally:
                    ex.resume()
                engine.set_version(version)
                for old in weights_dir.glob("v*"):  # keep the two newest versions
                    if old.is_dir() and old.name[1:].isdigit() and int(old.name[1:]) < version - 1:
                        shutil.rmtree(old, ignore_errors=True)
                reward_all = float(batch["rewards"].mean())
                if flt is not None:  # the batch is filtered; the success rate is over every group generated
                    d_sum, d_n = flt.reward_sum - seen[0], flt.reward_count - seen[1]
                    reward_all = d_sum / d_n if d_n else reward_all
                    seen = (flt.reward_sum, flt.reward_count)
                stat = {"step": step, "version": version, "reward_mean": reward_all,
                        "batch_reward_mean": float(batch["rewards"].mean()),
                        "rollout_wait_s": round(t_rollout, 3), "step_s": round(time.monotonic() - t_step, 3),
                        "elapsed_s": round(time.monotonic() - t0, 3),
                        **{f"train/{k}": v for k, v in train_stats.items()},
                        **{f"executor/{k}": v for k, v in ex.stats.items()},
                        **({f"filter/{k}": v for k, v in flt.stats.items()} if flt else {})}
                history.append(stat)
                mf.write(json.dumps(stat) + "\n")
                mf.flush()
                if writer is not None:
                    for k, v in stat.items():
                        if isinstance(v, (int, float)):
                            writer.add_scalar(k, v, step)
                logger.info("step %d: reward %.3f, loss %.4f, %d tokens, grad norm %.3f, staleness %.2f, %.1fs",
                            step, stat["reward_mean"], train_stats.get("loss", 0.0), train_stats.get("tokens", 0),
                            train_stats.get("grad_norm", 0.0), train_stats.get("staleness", 0.0), stat["step_s"])
    finally:
        backend.close()
        if writer is not None:
            writer.close()
        destroy_parallel_state()
    return history
