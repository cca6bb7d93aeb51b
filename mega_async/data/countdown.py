"""Countdown: a long-tailed task for asynchronous RL. Every step of the work is written out, so the
answer's length spans from a few tokens to a few hundred and a synchronous step waits for its longest sample.

A problem is `a>b:` with a > b, both zero-padded to `digits` digits; the answer counts down from a to b, every
number written and comma-separated (`012>009:` -> `012,011,010,009`), then EOS. The count m = a - b is drawn
log-uniformly in [min_count, max_count], so most answers are short and a few are long (at 3 digits and m in
[1, 74]: 7 to 299 tokens; of a batch of 8 prompts the longest is typically 3-8x the median). Each step is a
3-digit decrement with borrow and a comparison with b: local work a 4-layer model learns by SFT; the exact-match
reward (mega_async.reward.countdown) needs every step right, so a sampled answer fails more often the longer it
is, and a wrong step can overshoot b and run to max_new_tokens: RL has something to improve at every length.

Characters are single tokens as in mega_async.data.addition (digits, `>`, `:`, `,`); items carry input_ids.
Splits are disjoint by problem (a hash of (a, b) puts 5% in `eval`).

    python -m mega_async.data.countdown --model models/tiny-addition --split train --n 4096 --out rl.jsonl
"""
from __future__ import annotations

import argparse
import hashlib
import math
import random
import sys
from typing import Any, Optional, Sequence

from mega_async.data.addition import SPLITS, encode, sft_example, write_jsonl

CHARS = "0123456789>:,"
EVAL_PERMILLE = 50
__all__ = ["CHARS", "answer_text", "char_ids", "countdown_items", "problems", "prompt_text", "sft_example",
           "write_jsonl"]


def prompt_text(a: int, b: int, digits: int) -> str:
    return f"{a:0{digits}d}>{b:0{digits}d}:"


def answer_text(a: int, b: int, digits: int) -> str:
    """a, a-1, ..., b, zero-padded and comma-separated: (a - b + 1) * (digits + 1) - 1 characters."""
    return ",".join(f"{x:0{digits}d}" for x in range(a, b - 1, -1))


def split_of(a: int, b: int, digits: int) -> str:
    h = int.from_bytes(hashlib.blake2b(f"countdown:{digits}:{a}:{b}".encode(), digest_size=4).digest(), "big")
    return "eval" if h % 1000 < EVAL_PERMILLE else "train"


def check_params(digits: int, min_count: int, max_count: int) -> None:
    if not 1 <= digits <= 9:
        raise ValueError(f"digits={digits} must be in [1, 9]")
    if not 1 <= min_count <= max_count < 10 ** digits:
        raise ValueError(f"countdown counts [{min_count}, {max_count}] must satisfy 1 <= min_count <= max_count < "
                         f"10**digits = {10 ** digits}")


def problems(n: int, digits: int, seed: int, split: str = "train", min_count: int = 1,
             max_count: int = 74) -> list[tuple[int, int]]:
    """`n` problems (a, b) of `split`, seeded; m = a - b log-uniform in [min_count, max_count], b uniform."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {', '.join(SPLITS)}")
    check_params(digits, min_count, max_count)
    rng = random.Random(f"countdown:{digits}:{split}:{seed}:{min_count}:{max_count}")
    top = 10 ** digits
    lo, hi = math.log(min_count), math.log(max_count + 1)
    out: list[tuple[int, int]] = []
    while len(out) < n:
        m = min(max_count, int(math.exp(rng.uniform(lo, hi))))
        b = rng.randrange(top - m)
        if split_of(b + m, b, digits) == split:
            out.append((b + m, b))
    return out


def char_ids(tokenizer: Any) -> dict[str, int]:
    """Token id of each task character; ValueError when the vocabulary lacks one as a single token."""
    out = {}
    for c in CHARS:
        ids = tokenizer(c, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"the tokenizer encodes {c!r} as {len(ids)} tokens; the countdown task needs each of "
                             f"{CHARS!r} as one token (use a byte-level or character vocabulary)")
        out[c] = ids[0]
    return out


def countdown_items(n: int, digits: int, tokenizer: Any, seed: int = 0, split: str = "train", min_count: int = 1,
                    max_count: int = 74) -> list[dict[str, Any]]:
    """Rollout items: {input_ids, prompt, answer, count} (the reward compares the completion with `answer`)."""
    ids = char_ids(tokenizer)
    items = []
    for a, b in problems(n, digits, seed, split, min_count, max_count):
        p = prompt_text(a, b, digits)
        items.append({"input_ids": encode(p, ids), "prompt": p, "answer": answer_text(a, b, digits), "count": a - b})
    return items


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-addition", help="model card whose tokenizer encodes the prompts")
    ap.add_argument("--digits", type=int, default=3)
    ap.add_argument("--min-count", type=int, default=1)
    ap.add_argument("--max-count", type=int, default=74)
    ap.add_argument("--split", default="train", choices=SPLITS)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    items = countdown_items(a.n, a.digits, AutoTokenizer.from_pretrained(a.model), a.seed, a.split, a.min_count,
                            a.max_count)
    print(f"wrote {len(items)} {a.split} problems to {write_jsonl(items, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
