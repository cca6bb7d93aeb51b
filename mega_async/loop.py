"""Drivers. `run_rollout`: the rollout layer on its own (no trainer yet):
prepare_batch -> stats -> pause -> interrupt engine -> version += 1 -> resume, per step.
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
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


def make_engine(cfg: RunConfig) -> Any:
    if cfg.inference.backend == "simulated":
        from mega_async.inference.simulated import SimulatedEngine

        return SimulatedEngine(vocab_size=64, token_latency=(0.0, 0.002), seed=cfg.seed)
    raise NotImplementedError(
        f"inference.backend={cfg.inference.backend} is not available in this build; use inference.backend=simulated"
    )


def run_rollout(cfg: RunConfig, engine: Any = None) -> list[dict[str, float]]:
    """Run `trainer.total_steps` rollout steps with weight-version bumps; returns per-step stats."""
    run_dir = cfg.run_dir
    save_config(cfg, run_dir)
    engine = engine if engine is not None else make_engine(cfg)
    r = cfg.rollout
    data = build_dataset(cfg, getattr(engine, "vocab_size", 64))
    workflow = GroupWorkflow(
        RLVRWorkflow(reward_for(cfg), tokenizer=getattr(engine, "tokenizer", None), max_new_tokens=r.max_new_tokens,
                     temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, reward_timeout=r.reward_timeout),
        r.group_size,
    )
    flt = DynamicFilter() if r.dynamic_filter else None
    history = []
    metrics_path = run_dir / "metrics.jsonl"
    with WorkflowExecutor.from_config(r, engine, workflow, should_accept=flt) as ex, metrics_path.open("a") as mf:
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
            # weight update protocol (no trainer yet): pause -> interrupt -> version += 1 -> resume
            ex.pause()
            try:
                engine.pause_generation()
                try:
                    engine.set_version(step + 1)
                    ex.set_version(step + 1)
                finally:
                    engine.continue_generation()
            finally:
                ex.resume()
    return history
