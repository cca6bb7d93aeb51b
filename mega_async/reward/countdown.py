"""Exact-match reward of the countdown task (mega_async.data.countdown): 1.0 when the completion, without
surrounding whitespace, is the whole worked countdown exactly (every number from a down to b), else 0.0."""
from __future__ import annotations


def countdown_reward(prompt: str, completion: str, answer: str, **_: object) -> float:
    return 1.0 if completion.strip() == str(answer) else 0.0
