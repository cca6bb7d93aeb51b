"""GSM8K reward: 1.0 when the completion's final answer equals the number after `####`."""
from __future__ import annotations

import logging

from math_verify import parse, verify

# math-verify warns on every call that its own (SIGALRM) timeouts are off; we time out outside.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).setLevel(logging.ERROR)


def gold_answer(answer: str) -> str:
    """The reference number of a GSM8K `answer` field (text after the last `####`)."""
    if "####" not in answer:
        raise ValueError("GSM8K answer has no '#### <number>' line")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def gsm8k_reward(prompt: str, completion: str, answer: str, **_: object) -> float:
    # Timeouts off: math-verify's own timeouts use SIGALRM, which only works in the main thread;
    # the RewardRunner applies its own timeout around this call instead.
    gold = parse(gold_answer(answer), parsing_timeout=None)
    pred = parse(completion, parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
