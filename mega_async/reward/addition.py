"""Exact-match reward of the addition task (mega_async.data.addition): 1.0 when the completion, without
surrounding whitespace, is the answer's digits exactly, else 0.0. Nothing partial: a wrong digit, a missing
or extra digit all score 0."""
from __future__ import annotations


def addition_reward(prompt: str, completion: str, answer: str, **_: object) -> float:
    return 1.0 if completion.strip() == str(answer) else 0.0
