"""Drivers. `run_rollout`: the rollout layer on its own (no trainer yet):
prepare_batch -> stats -> pause -> interrupt engine -> version += 1 -> resume, per step.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

from mega_async.config import RunConfig, save_config
from mega_async.data import gsm8k_items, load_rows, synthetic_items
from mega_async.rollout.executor import WorkflowExecutor
from mega_async.rollout.filters import DynamicFilter
from mega_async.rollout.workflow import GroupWorkflow, RLVRWorkflow

logger = logging.getLogger("mega_async.loop")


def build_dataset(cfg: RunConfig, vocab_size: int) -> list[dict[str, Any]]:
    d = cfg.data
    if d.name == "synthetic":
        return synthetic_items(1024, vocab_size, seed=cfg.seed)
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

    def __init__(self, cfg: RunConfig):
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
                              dtype=cfg.model.dtype, seed=cfg.seed, extra_args=inf.extra_args)
            self.launcher = ServerLauncher(spec, log_dir=str(cfg.run_dir / "server_logs"))
            addresses = self.launcher.start()
        self.engine = SGLangClient(addresses, api_key=inf.api_key, request_timeout=inf.request_timeout)

    def weight_step(self, version: int) -> None:
        """pause -> push weights -> version -> continue. No trainer yet: the servers reload the model card
        from disk, which exercises the real update path; the simulator just interrupts."""
        if self.cfg.inference.backend == "simulated":
            self.engine.pause_generation()
            try:
                self.engine.set_version(version)
            finally:
                self.engine.continue_generation()
            return
        client = self.engine
        path = str(Path(self.cfg.model.path).resolve())
        asyncio.run(client.update_weights(lambda: client.update_weights_from_disk(path, version), version))

    def close(self) -> None:
        if self.launcher is not None:
            self.launcher.stop()


def run_rollout(cfg: RunConfig) -> list[dict[str, float]]:
    """Run `trainer.total_steps` rollout steps with weight-version bumps; returns per-step stats."""
    run_dir = cfg.run_dir
    save_config(cfg, run_dir)
    backend = RolloutBackend(cfg)
    try:
        return _rollout_steps(cfg, backend)
    finally:
        backend.close()


def _rollout_steps(cfg: RunConfig, backend: RolloutBackend) -> list[dict[str, float]]:
    run_dir, r = cfg.run_dir, cfg.rollout
    data = build_dataset(cfg, backend.vocab_size)
    workflow = GroupWorkflow(
        RLVRWorkflow(reward_for(cfg), tokenizer=backend.tokenizer, max_new_tokens=r.max_new_tokens,
                     temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, reward_timeout=r.reward_timeout),
        r.group_size,
    )
    flt = DynamicFilter() if r.dynamic_filter else None
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
