"""Rollout workflows: one episode = prompt -> generation(s) -> reward -> trajectory tensors.

A trajectory is a dict of [n, L] tensors (n sequences, right-padded): input_ids, attention_mask,
loss_mask (1 on output tokens), logprobs (behaviour), versions (-1 on prompt tokens), plus
per-sequence `rewards` [n].
"""
from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from typing import Any, Callable, Optional

import torch

from mega_async.reward import RewardRunner
from mega_async.types import ModelRequest, ModelResponse, concat_padded

logger = logging.getLogger("mega_async.rollout.workflow")


class RolloutWorkflow(ABC):
    """Subclasses implement one episode; return None to reject it (it then returns its budget)."""

    @abstractmethod
    async def arun_episode(self, engine: Any, data: Any) -> Optional[dict]:
        ...


class GroupWorkflow(RolloutWorkflow):
    """Run `group_size` episodes of `workflow` on the same item concurrently (GRPO groups).

    Rejected members are dropped; the group is rejected only when every member is.
    """

    def __init__(self, workflow: RolloutWorkflow, group_size: int):
        if group_size < 1:
            raise ValueError(f"group_size={group_size} must be >= 1")
        self.workflow = workflow
        self.group_size = group_size

    async def arun_episode(self, engine: Any, data: Any) -> Optional[dict]:
        results = await asyncio.gather(*(self.workflow.arun_episode(engine, data) for _ in range(self.group_size)))
        kept = [r for r in results if r is not None]
        if not kept:
            return None
        return concat_padded(kept)


def trajectory_from_response(prompt_ids: list[int], resp: ModelResponse, reward: float) -> dict[str, torch.Tensor]:
    """Build the [1, L] trajectory tensors from one generation."""
    n_out = len(resp.output_tokens)
    if not (len(resp.output_logprobs) == len(resp.output_versions) == n_out):
        raise ValueError(
            f"response lengths disagree: {n_out} tokens, {len(resp.output_logprobs)} logprobs, "
            f"{len(resp.output_versions)} versions"
        )
    n_in = len(prompt_ids)
    seq = list(prompt_ids) + list(resp.output_tokens)
    return {
        "input_ids": torch.tensor([seq], dtype=torch.long),
        "attention_mask": torch.ones(1, len(seq), dtype=torch.long),
        "loss_mask": torch.tensor([[0] * n_in + [1] * n_out], dtype=torch.long),
        "logprobs": torch.tensor([[0.0] * n_in + list(resp.output_logprobs)], dtype=torch.float32),
        "versions": torch.tensor([[-1] * n_in + list(resp.output_versions)], dtype=torch.long),
        "rewards": torch.tensor([float(reward)], dtype=torch.float32),
    }


class RLVRWorkflow(RolloutWorkflow):
    """RL with verifiable rewards: prompt -> agenerate -> reward(prompt, completion, **item) -> trajectory.

    Items carry `input_ids` (token ids) or `prompt` (text) or `messages` (chat; needs a tokenizer
    with a chat template). The remaining fields of the item go to the reward function.
    """

    def __init__(
        self,
        reward_fn: Callable[..., Any],
        tokenizer: Any = None,
        *,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        stop_token_ids: Optional[list[int]] = None,
        reward_timeout: float = 15.0,
    ):
        self.reward = RewardRunner(reward_fn, timeout=reward_timeout)
        self.tokenizer = tokenizer
        self.sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k)
        if stop_token_ids is None and tokenizer is not None and tokenizer.eos_token_id is not None:
            stop_token_ids = [tokenizer.eos_token_id]
        self.stop_token_ids = list(stop_token_ids or [])

    def encode(self, data: dict) -> tuple[list[int], str]:
        """Prompt token ids and prompt text for one item."""
        if "input_ids" in data:
            ids = [int(t) for t in data["input_ids"]]
            text = data.get("prompt") or (self.tokenizer.decode(ids) if self.tokenizer is not None else "")
            return ids, text
        if self.tokenizer is None:
            raise ValueError("item has no input_ids and the workflow has no tokenizer to encode its prompt")
        if "messages" in data:
            text = self.tokenizer.apply_chat_template(data["messages"], tokenize=False, add_generation_prompt=True)
        elif "prompt" in data:
            text = data["prompt"]
        else:
            raise ValueError(f"item needs input_ids, prompt or messages; got keys {sorted(data)}")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), text

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""

    async def arun_episode(self, engine: Any, data: Any) -> Optional[dict]:
        prompt_ids, prompt_text = self.encode(data)
        req = ModelRequest(input_ids=prompt_ids, stop_token_ids=self.stop_token_ids, **self.sampling)
        resp = await engine.agenerate(req)
        item = {k: v for k, v in data.items() if k not in ("input_ids", "prompt", "messages")}
        item["output_tokens"] = resp.output_tokens
        reward = await self.reward(prompt_text, self.decode(resp.output_tokens), **item)
        if reward is None:
            return None
        return trajectory_from_response(prompt_ids, resp, reward)
