"""Few-digit addition, a task a tiny model learns by SFT and improves by RL (exact-match reward).

A problem is `a+b=` with both operands zero-padded to `digits` digits (every prompt has one length); the answer
is the sum as usual (most significant digit first, no padding: `047+259=` -> `306`), then EOS. Every character is
one token (the tiny cards' byte-level vocabulary holds each digit, `+` and `=`; the BPE's merged tokens such as
"12" are never used for the prompt), and items carry their `input_ids`, so no merge changes what the model sees.
A 4-layer model learns it by SFT in about a thousand steps, with a sharp rise in the middle (exact match goes
from 0 to 60% within ~250 steps): the SFT config stops in that rise and RL continues from there.

Splits are disjoint by problem: a problem (a, b) belongs to `eval` when a hash of it falls in the lowest
`EVAL_PERMILLE` per mille, else to `train` (SFT and RL prompts draw from train, with different seeds).

    python -m mega_async.data.addition --model models/tiny-addition --split train --n 4096 --out rl.jsonl
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

CHARS = "0123456789+="
EVAL_PERMILLE = 50  # 5% of all problems are held out for evaluation
SPLITS = ("train", "eval")


def prompt_text(a: int, b: int, digits: int) -> str:
    return f"{a:0{digits}d}+{b:0{digits}d}="


def answer_text(a: int, b: int, digits: int) -> str:
    """The sum in decimal (`digits` or `digits + 1` digits)."""
    return str(a + b)


def split_of(a: int, b: int, digits: int) -> str:
    h = int.from_bytes(hashlib.blake2b(f"{digits}:{a}:{b}".encode(), digest_size=4).digest(), "big")
    return "eval" if h % 1000 < EVAL_PERMILLE else "train"


def char_ids(tokenizer: Any) -> dict[str, int]:
    """Token id of each task character; ValueError when the vocabulary lacks one as a single token."""
    out = {}
    for c in CHARS:
        ids = tokenizer(c, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"the tokenizer encodes {c!r} as {len(ids)} tokens; the addition task needs each of "
                             f"{CHARS!r} as one token (use a byte-level or character vocabulary)")
        out[c] = ids[0]
    return out


def encode(text: str, ids: dict[str, int]) -> list[int]:
    return [ids[c] for c in text]


def problems(n: int, digits: int, seed: int, split: str = "train") -> list[tuple[int, int]]:
    """`n` random problems (a, b) of `split`, seeded; repeats are possible (the space is 10^(2 digits))."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {', '.join(SPLITS)}")
    if not 1 <= digits <= 9:
        raise ValueError(f"digits={digits} must be in [1, 9]")
    rng = random.Random(f"addition:{digits}:{split}:{seed}")
    hi = 10 ** digits
    out: list[tuple[int, int]] = []
    while len(out) < n:
        a, b = rng.randrange(hi), rng.randrange(hi)
        if split_of(a, b, digits) == split:
            out.append((a, b))
    return out


def addition_items(n: int, digits: int, tokenizer: Any, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """Rollout items: {input_ids, prompt, answer} (the reward compares the completion with `answer`)."""
    ids = char_ids(tokenizer)
    items = []
    for a, b in problems(n, digits, seed, split):
        p = prompt_text(a, b, digits)
        items.append({"input_ids": encode(p, ids), "prompt": p, "answer": answer_text(a, b, digits)})
    return items


def sft_example(item: dict[str, Any], ids: dict[str, int], eos: int) -> tuple[list[int], list[int]]:
    """(tokens, loss mask) of one SFT sequence: prompt, answer, EOS; the mask is 1 on answer and EOS."""
    ans = encode(item["answer"], ids) + [eos]
    return list(item["input_ids"]) + ans, [0] * len(item["input_ids"]) + [1] * len(ans)


def write_jsonl(items: Sequence[dict[str, Any]], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(json.dumps(it) + "\n" for it in items))
    tmp.replace(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-addition", help="model card whose tokenizer encodes the prompts")
    ap.add_argument("--digits", type=int, default=3)
    ap.add_argument("--split", default="train", choices=SPLITS)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    items = addition_items(a.n, a.digits, AutoTokenizer.from_pretrained(a.model), seed=a.seed, split=a.split)
    print(f"wrote {len(items)} {a.split} problems to {write_jsonl(items, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
