"""Evaluation on the held-out split: greedy pass@1 over N problems, generated on the run's servers at the
current weights version, every `trainer.eval_interval` steps (rank 0, between steps; rollout goes on)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

from mega_async.reward import RewardRunner
from mega_async.rollout.workflow import RLVRWorkflow, gather_or_cancel
from mega_async.api.types import ModelRequest

logger = logging.getLogger("mega_async.run.evaluation")


class Evaluator:
    """Scores `items` greedily (temperature 0, one sample each); a failed reward scores 0."""

    def __init__(self, items: list[dict[str, Any]], engine: Any, tokenizer: Any, reward_fn: Callable[..., Any], *,
                 interval: int, max_new_tokens: int, reward_timeout: float = 15.0, concurrency: int = 64):
        if not items:
            raise ValueError("evaluation needs at least one held-out problem")
        if interval < 1:
            raise ValueError(f"interval={interval} must be >= 1")
        self.items = items
        self.engine = engine
        self.interval = interval
        self.max_new_tokens = max_new_tokens
        self.concurrency = concurrency
        self.prompts = RLVRWorkflow(reward_fn, tokenizer=tokenizer)  # prompt encoding and decoding only
        self.reward = RewardRunner(reward_fn, timeout=reward_timeout)

    @classmethod
    def from_config(cls, cfg: Any, service: Any, reward_fn: Callable[..., Any]) -> Optional["Evaluator"]:
        """The run's evaluator (scoring with the run's reward), or None when `trainer.eval_interval` is 0."""
        if not cfg.trainer.eval_interval:
            return None
        held = cfg_heldout(cfg)
        logger.info("evaluation every %d steps: greedy pass@1 over %d held-out problems", cfg.trainer.eval_interval,
                    len(held))
        return cls(held, service.engine, service.tokenizer, reward_fn, interval=cfg.trainer.eval_interval,
                   max_new_tokens=cfg.rollout.max_new_tokens, reward_timeout=cfg.rollout.reward_timeout)

    def due(self, step: int) -> bool:
        return (step + 1) % self.interval == 0

    def maybe_evaluate(self, step: int) -> dict[str, float]:
        """`eval/*` metrics when `step` is an evaluation step, else {}."""
        return self.evaluate() if self.due(step) else {}

    def evaluate(self) -> dict[str, float]:
        t0 = time.monotonic()
        results = asyncio.run(self._run_all())
        scores = [r[0] for r in results]
        out = {"eval/pass@1": sum(scores) / len(scores), "eval/problems": len(scores),
               "eval/output_tokens_mean": sum(r[1] for r in results) / len(results),
               "eval/truncated_frac": sum(r[2] for r in results) / len(results),
               "eval/reward_failures": sum(r[3] for r in results), "eval/s": round(time.monotonic() - t0, 3)}
        logger.info("eval: pass@1 %.3f over %d problems (%.1fs)", out["eval/pass@1"], len(scores), out["eval/s"])
        return out

    async def _run_all(self) -> list[tuple[float, int, bool, bool]]:
        sem = asyncio.Semaphore(self.concurrency)

        async def one(item: dict[str, Any]) -> tuple[float, int, bool, bool]:
            async with sem:
                return await self._score(item)

        return await gather_or_cancel(*(one(it) for it in self.items))

    async def _score(self, item: dict[str, Any]) -> tuple[float, int, bool, bool]:
        """(score, output tokens, truncated, reward failed) of one greedy generation."""
        ids, prompt = self.prompts.encode(item)
        req = ModelRequest(input_ids=ids, max_new_tokens=self.max_new_tokens, temperature=0.0,
                           stop_token_ids=self.prompts.stop_token_ids)
        resp = await self.engine.agenerate(req)
        fields = {k: v for k, v in item.items() if k not in ("input_ids", "prompt", "messages")}
        value = await self.reward(prompt, self.prompts.decode(resp.output_tokens), **fields)
        truncated = resp.stop_reason == "length"
        return (float(value) if value is not None else 0.0), len(resp.output_tokens), truncated, value is None


def cfg_heldout(cfg: Any) -> list[dict[str, Any]]:
    """The held-out GSM8K items of a run config (data.eval_* keys)."""
    from mega_async.data.gsm8k import load_gsm8k

    d = cfg.data
    return load_gsm8k(d.path, d.split, eval_path=d.eval_path, eval_split=d.eval_split, eval_size=d.eval_size,
                      chat=d.chat_template, max_row_bytes=d.max_row_bytes).heldout
