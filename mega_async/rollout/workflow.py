"""Rollout workflows: one episode = prompt -> generation(s) -> reward -> trajectory tensors.

A trajectory is a dict of [n, L] tensors (n sequences, right-padded): input_ids, attention_mask,
loss_mask (1 on output tokens), logprobs (behaviour), versions (-1 on prompt tokens), plus
per-sequence `rewards` [n].
"""
from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from typing import Any, Awaitable, Callable, Optional

import torch

from mega_async.reward import RewardRunner
from mega_async.algo.batch import concat_padded
from mega_async.api.types import ModelRequest, ModelResponse

logger = logging.getLogger("mega_async.rollout.workflow")

GEN_TIME_KEY = "gen_s"  # per-sequence generation seconds; taken off the batch before it reaches the trainer


class RolloutWorkflow(ABC):
    """Subclasses implement one episode; return None to reject it (it then returns its budget)."""

    @abstractmethod
    async def arun_episode(self, engine: Any, data: Any) -> Optional[dict]:
        ...


async def gather_or_cancel(*aws: Awaitable[Any]) -> list[Any]:
    """asyncio.gather that, when one fails or it is cancelled, cancels the others and waits for them before it
    raises: a plain gather leaves them running, and their errors were logged as "never retrieved" after the
    run's own last line (a dead server's group members each failed on their own)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


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
        results = await gather_or_cancel(*(self.workflow.arun_episode(engine, data) for _ in range(self.group_size)))
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
    # one tensor per dtype (a torch.tensor call costs more than the copy): rows are views of it
    ints = torch.tensor([seq, [1] * len(seq), [0] * n_in + [1] * n_out, [-1] * n_in + list(resp.output_versions)],
                        dtype=torch.long)
    floats = torch.tensor([0.0] * n_in + list(resp.output_logprobs) + [float(reward)], dtype=torch.float32)
    return {
        "input_ids": ints[0:1],
        "attention_mask": ints[1:2],
        "loss_mask": ints[2:3],
        "logprobs": floats[None, :-1],
        "versions": ints[3:4],
        "rewards": floats[-1:],
        **_routes(resp.routed_experts, len(seq)),
    }


def _routes(rows: Any, length: int) -> dict[str, torch.Tensor]:
    """{"routed_experts": [1, L, layers * top_k]} beside versions (-1 where no forward ran), or {} without routes."""
    if rows is None:
        return {}
    out = torch.full((1, length, rows.shape[1]), -1, dtype=torch.int32)
    out[0, :rows.shape[0]] = rows
    return {"routed_experts": out}


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
        return_routed_experts: bool = False,
    ):
        self.reward = RewardRunner(reward_fn, timeout=reward_timeout)
        self.tokenizer = tokenizer
        self.sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                             return_routed_experts=return_routed_experts)
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
        t0 = time.monotonic()
        resp = await engine.agenerate(req)
        gen_s = time.monotonic() - t0  # interruptions and resubmissions included
        item = {k: v for k, v in data.items() if k not in ("input_ids", "prompt", "messages")}
        item["output_tokens"] = resp.output_tokens
        reward = await self.reward(prompt_text, self.decode(resp.output_tokens), **item)
        if reward is None:
            return None
        # the sample's generation time: the batch statistics' long tail (mega_async.trainer.dispatch.batch_stats)
        return {**trajectory_from_response(prompt_ids, resp, reward), GEN_TIME_KEY: torch.tensor([gen_s])}


class Trajectory:
    """One growing token sequence: prompt and feedback tokens (not trained) and model tokens (trained, with
    their behaviour logprobs and versions)."""

    def __init__(self, prompt_ids: list[int]):
        self.ids = list(prompt_ids)
        self.loss_mask = [0] * len(self.ids)
        self.logprobs = [0.0] * len(self.ids)
        self.versions = [-1] * len(self.ids)
        self.routes: Any = None  # rows of earlier turns keep the routes they were generated with

    def add_context(self, ids: list[int]) -> None:
        self.ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_output(self, resp: ModelResponse) -> None:
        n = len(resp.output_tokens)
        if not (len(resp.output_logprobs) == len(resp.output_versions) == n):
            raise ValueError(f"response lengths disagree: {n} tokens, {len(resp.output_logprobs)} logprobs, "
                             f"{len(resp.output_versions)} versions")
        self.ids += list(resp.output_tokens)
        self.loss_mask += [1] * n
        self.logprobs += [float(x) for x in resp.output_logprobs]
        self.versions += [int(v) for v in resp.output_versions]
        if resp.routed_experts is not None:
            held = self.routes
            self.routes = resp.routed_experts if held is None else torch.cat(
                [held, resp.routed_experts[held.shape[0]:]])

    def tensors(self, reward: float) -> dict[str, torch.Tensor]:
        """The [1, L] trajectory dict."""
        return {
            "input_ids": torch.tensor([self.ids], dtype=torch.long),
            "attention_mask": torch.ones(1, len(self.ids), dtype=torch.long),
            "loss_mask": torch.tensor([self.loss_mask], dtype=torch.long),
            "logprobs": torch.tensor([self.logprobs], dtype=torch.float32),
            "versions": torch.tensor([self.versions], dtype=torch.long),
            "rewards": torch.tensor([float(reward)], dtype=torch.float32),
            **_routes(self.routes, len(self.ids)),
        }


DEFAULT_FEEDBACK = ("Your answer is wrong or could not be parsed. Read the question again, check your previous "
                    "attempt, and answer again.")


class MultiTurnWorkflow(RLVRWorkflow):
    """Retry on a wrong answer: after a reward <= 0 a feedback user turn is appended (chat-template token ids,
    never re-tokenized output) and the model tries again, up to `max_turns`; the reward of the answering turn
    is multiplied by `turn_discount` per extra turn. Only model tokens are trained (loss_mask); each keeps the
    logprob and version it was generated with, through interruptions. `feedback_ids` replaces the templated
    feedback turn (for token-only tasks without a chat template)."""

    def __init__(self, reward_fn: Callable[..., Any], tokenizer: Any = None, *, max_turns: int = 3,
                 turn_discount: float = 0.9, feedback: str = DEFAULT_FEEDBACK,
                 feedback_ids: Optional[list[int]] = None, max_context: Optional[int] = None, **kw: Any):
        if max_turns < 1 or not 0 < turn_discount <= 1:
            raise ValueError(f"max_turns={max_turns} must be >= 1 and turn_discount={turn_discount} in (0, 1]")
        if tokenizer is None and feedback_ids is None and max_turns > 1:
            raise ValueError("MultiTurnWorkflow needs a tokenizer with a chat template, or feedback_ids")
        super().__init__(reward_fn, tokenizer, **kw)
        self.max_turns, self.turn_discount = max_turns, turn_discount
        self.feedback, self.feedback_ids, self.max_context = feedback, feedback_ids, max_context
        if tokenizer is not None and kw.get("stop_token_ids") is None:
            from mega_async.rollout.chat import end_of_turn_id

            eot = end_of_turn_id(tokenizer) if getattr(tokenizer, "chat_template", None) else None
            if eot is not None and eot not in self.stop_token_ids:
                self.stop_token_ids.append(eot)  # a turn ends where the template ends it

    def encode(self, data: dict) -> tuple[list[int], str]:
        if "messages" in data and self.tokenizer is not None:
            from mega_async.rollout.chat import prompt_ids, render

            return prompt_ids(self.tokenizer, data["messages"]), render(self.tokenizer, data["messages"], True)
        if "prompt" in data and "input_ids" not in data and getattr(self.tokenizer, "chat_template", None):
            msgs = [{"role": "user", "content": data["prompt"]}]
            from mega_async.rollout.chat import prompt_ids

            return prompt_ids(self.tokenizer, msgs), data["prompt"]
        return super().encode(data)

    def feedback_turn(self, output_ids: list[int]) -> list[int]:
        """Token ids that close the model's turn and add the feedback user turn plus the generation prompt."""
        if self.feedback_ids is not None:
            return list(self.feedback_ids)
        from mega_async.rollout.chat import close_ids, turn_ids

        return close_ids(self.tokenizer, output_ids) + turn_ids(self.tokenizer, [{"role": "user",
                                                                                   "content": self.feedback}])

    async def arun_episode(self, engine: Any, data: Any) -> Optional[dict]:
        prompt, prompt_text = self.encode(data)
        item = {k: v for k, v in data.items() if k not in ("input_ids", "prompt", "messages")}
        traj, discount, reward = Trajectory(prompt), 1.0, 0.0
        for turn in range(self.max_turns):
            req = ModelRequest(input_ids=list(traj.ids), stop_token_ids=self.stop_token_ids, **self.sampling)
            resp = await engine.agenerate(req)
            traj.add_output(resp)
            item["output_tokens"] = resp.output_tokens
            reward = await self.reward(prompt_text, self.decode(resp.output_tokens), **item)
            if reward is None:
                return None
            if reward > 0 or turn == self.max_turns - 1:
                break
            nxt = self.feedback_turn(resp.output_tokens)
            if self.max_context is not None and len(traj.ids) + len(nxt) + self.sampling["max_new_tokens"] > \
                    self.max_context:
                logger.debug("episode stops after turn %d: another turn would exceed %d tokens", turn, self.max_context)
                break
            traj.add_context(nxt)
            discount *= self.turn_discount
        return traj.tensors(reward * discount)


def make_workflow(cfg: Any, tokenizer: Any, reward_fn: Callable[..., Any]) -> RolloutWorkflow:
    """The episode workflow of `rollout.workflow`: rlvr, multi_turn, or a user's `package.module:factory`
    called as factory(cfg, tokenizer, reward_fn)."""
    r = cfg.rollout
    kw = dict(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
              reward_timeout=r.reward_timeout,
              return_routed_experts=r.return_routed_experts or cfg.algorithm.routing_replay)
    if r.workflow == "rlvr":
        return RLVRWorkflow(reward_fn, tokenizer, **kw)
    if r.workflow == "multi_turn":
        ctx = getattr(tokenizer, "model_max_length", None)
        return MultiTurnWorkflow(reward_fn, tokenizer, max_turns=r.max_turns, turn_discount=r.turn_discount,
                                 max_context=ctx if isinstance(ctx, int) and ctx < 1 << 30 else None, **kw)
    import importlib

    module, _, name = r.workflow.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rollout.workflow={r.workflow!r}: cannot load it ({type(e).__name__}: {e})") from None
    wf = factory(cfg, tokenizer, reward_fn)
    if not isinstance(wf, RolloutWorkflow):
        raise ValueError(f"rollout.workflow={r.workflow!r} returned {type(wf).__name__}, not a RolloutWorkflow")
    return wf
