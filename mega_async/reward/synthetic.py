"""Synthetic task reward for smoke runs without a tokenizer: did the policy emit the target token?"""
from __future__ import annotations


def target_token_reward(prompt: str, completion: str, target: int, output_tokens: list[int], **_: object) -> float:
    return 1.0 if int(target) in output_tokens else 0.0
