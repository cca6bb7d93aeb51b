"""Datasets as lists of dict items: local jsonl/parquet files, GSM8K, and a synthetic token task."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any


MAX_ROW_BYTES = 32 << 20  # data.max_row_bytes: a bigger row is refused before anything tokenizes it


def load_rows(path: str | Path, max_row_bytes: int = MAX_ROW_BYTES) -> list[dict[str, Any]]:
    """Rows of a .jsonl or .parquet file (parquet needs pyarrow). ValueError (one line, `file:line` or `file: row
    N`) for a row that is not UTF-8, not JSON, not an object, or larger than `max_row_bytes` (a 200 MB row took
    3.3 GB to tokenize and the run died of an allocation failure); a jsonl row is never read past that bound."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file {p} not found; set data.path to a .jsonl or .parquet file")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("reading parquet needs pyarrow: pip install pyarrow") from None
        return check_row_sizes(pq.read_table(p).to_pylist(), str(p), max_row_bytes)
    rows = []
    with p.open("rb") as f:
        for n, raw in enumerate(iter(lambda: f.readline(max_row_bytes + 2), b""), 1):
            if len(raw) - raw.endswith(b"\n") > max_row_bytes:
                raise ValueError(f"{p}:{n}: {_too_big(max_row_bytes)}")
            if raw.strip():
                rows.append(_parse(raw, f"{p}:{n}"))
    return rows


def check_row_sizes(rows: list[dict[str, Any]], where: str, max_row_bytes: int) -> list[dict[str, Any]]:
    """Rows read whole (parquet, a hub dataset), each at most about `max_row_bytes` (ValueError naming the row)."""
    for i, row in enumerate(rows):
        if _size(row) > max_row_bytes:
            raise ValueError(f"{where}: row {i}: {_too_big(max_row_bytes)}")
    return rows


def _too_big(limit: int) -> str:
    return (f"row larger than data.max_row_bytes={limit} bytes; drop or shorten the row, or raise "
            "data.max_row_bytes")


def _size(x: Any) -> int:
    """About the bytes of a parquet row's values (characters of its strings)."""
    if isinstance(x, (str, bytes)):
        return len(x)
    if isinstance(x, dict):
        return sum(_size(k) + _size(v) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return sum(_size(v) for v in x)
    return 8


def _parse(raw: bytes, where: str) -> dict[str, Any]:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 ({e.reason} at byte {e.start + 1} of the row)") from None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError(f"{where}: invalid JSON (nested deeper than the parser goes)") from None
    except ValueError as e:  # an integer literal of more than sys.get_int_max_str_digits() digits
        raise ValueError(f"{where}: invalid JSON ({e})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    return row


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
