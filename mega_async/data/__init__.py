"""Datasets as lists of dict items: local jsonl/parquet files, GSM8K, and a synthetic token task."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a .jsonl or .parquet file (parquet needs pyarrow)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file {p} not found; set data.path to a .jsonl or .parquet file")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("reading parquet needs pyarrow: pip install pyarrow") from None
        return pq.read_table(p).to_pylist()
    rows = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{n}: invalid JSON ({e.msg})") from None
                except RecursionError:
                    raise ValueError(f"{p}:{n}: invalid JSON (nested deeper than the parser goes)") from None
                except ValueError as e:  # an integer literal of more than sys.get_int_max_str_digits() digits
                    raise ValueError(f"{p}:{n}: invalid JSON ({e})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{p}:{n}: a row must be a JSON object, got {type(row).__name__}")
                rows.append(row)
    return rows


def check_items(rows: list[dict[str, Any]], where: str, vocab_size: int) -> list[dict[str, Any]]:
    """Rows of a jsonl/parquet dataset for the rlvr and multi_turn workflows: each has `input_ids` (token ids in
    [0, vocab_size)), a `prompt` string or `messages` (chat turns with a string role). ValueError (one line)
    names the first row that has none of them or a malformed one."""
    for i, r in enumerate(rows):
        if "input_ids" in r:
            ids = r["input_ids"]
            if not (isinstance(ids, list) and ids and all(
                    type(t) is int and 0 <= t < vocab_size for t in ids)):  # noqa: E721 - bool is no token id
                raise ValueError(f"{where}: row {i}: input_ids must be a non-empty list of token ids in "
                                 f"[0, {vocab_size})")
        elif "messages" in r:
            msgs = r["messages"]
            if not (isinstance(msgs, list) and msgs and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs)):
                raise ValueError(f"{where}: row {i}: messages must be a non-empty list of {{role, content}} objects")
        elif "prompt" in r:
            if not isinstance(r["prompt"], str):
                raise ValueError(f"{where}: row {i}: prompt must be a string, got {type(r['prompt']).__name__}")
        else:
            raise ValueError(f"{where}: row {i} has no input_ids, prompt or messages (got {sorted(r)[:8]})")
    return rows


def synthetic_items(n: int, vocab_size: int, prompt_len: int = 8, seed: int = 0,
                    target: int | None = None) -> list[dict[str, Any]]:
    """Random prompts; the task is to emit `target` (see reward.synthetic.target_token_reward): one fixed
    token for every prompt when given (quickly learnable), else a random one per prompt."""
    if target is not None and not 0 < target < vocab_size:
        raise ValueError(f"synthetic target {target} outside the vocabulary [1, {vocab_size})")
    rng = random.Random(seed)
    return [
        {"input_ids": [rng.randrange(1, vocab_size) for _ in range(prompt_len)],
         "target": target if target is not None else rng.randrange(1, vocab_size)}
        for _ in range(n)
    ]
