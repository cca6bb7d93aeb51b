"""GSM8K: training and held-out problems from a local jsonl/parquet file or directory, or by dataset name
through `datasets` (when installed and online); prompts as chat messages (the tokenizer's chat template)
or as plain text.

Held-out split, in order: `data.eval_path`; the `data.eval_split` file beside a directory's train file;
the named dataset's `eval_split`; else the last `data.eval_size` rows of the data, kept out of training.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from mega_async.data import MAX_ROW_BYTES, check_row_sizes, load_rows

logger = logging.getLogger("mega_async.data.gsm8k")

DATASET_NAME = "openai/gsm8k"
INSTRUCTION = "Answer step by step and finish with 'The answer is <number>'."
TEXT_TEMPLATE = "Question: {question}\n" + INSTRUCTION + "\nAnswer:"


@dataclass
class GSM8KSplits:
    train: list[dict[str, Any]]
    heldout: list[dict[str, Any]]  # empty when no held-out split was asked for
    source: str  # where the rows came from (a path or the dataset name)


def to_item(row: dict[str, Any], chat: bool = True) -> dict[str, Any]:
    """A GSM8K row ({question, answer}) as a rollout item: `messages` (chat) or `prompt` (text), plus `answer`."""
    if chat:
        return {"messages": [{"role": "user", "content": f"{row['question']}\n{INSTRUCTION}"}], "answer": row["answer"]}
    return {"prompt": TEXT_TEMPLATE.format(question=row["question"]), "answer": row["answer"]}


def _check(rows: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or "question" not in r or "answer" not in r:
            got = sorted(r)[:8] if isinstance(r, dict) else type(r).__name__
            raise ValueError(f"{where}: row {i} lacks 'question'/'answer' (got {got}); is this GSM8K?")
        if not isinstance(r["question"], str) or not isinstance(r["answer"], str):
            raise ValueError(f"{where}: row {i}: 'question' and 'answer' must be strings; is this GSM8K?")
        if "####" not in r["answer"]:
            raise ValueError(f"{where}: row {i} answer has no '#### <number>' line; is this GSM8K?")
    return rows


def _split_file(d: Path, split: str) -> Optional[Path]:
    return next((d / f"{split}{ext}" for ext in (".jsonl", ".parquet") if (d / f"{split}{ext}").exists()), None)


def _local(path: Path, split: str, max_row_bytes: int = MAX_ROW_BYTES) -> tuple[list[dict[str, Any]], str]:
    p = _split_file(path, split) if path.is_dir() else path
    if p is None:
        raise FileNotFoundError(f"{path} has no {split}.jsonl or {split}.parquet; set data.path to a GSM8K file")
    return _check(load_rows(p, max_row_bytes), str(p)), str(p)


def _by_name(name: str, split: str, max_row_bytes: int = MAX_ROW_BYTES) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise FileNotFoundError(f"data.path={name!r} is not a local file and loading by dataset name needs the "
                                "`datasets` package (pip install datasets); or set data.path to a GSM8K .jsonl/.parquet "
                                "file") from None
    ds = datasets.load_dataset(name, "main", split=split)
    return _check(check_row_sizes([dict(r) for r in ds], f"{name}[{split}]", max_row_bytes), f"{name}[{split}]")


def load_gsm8k(path: Optional[str], split: str = "train", *, eval_path: Optional[str] = None,
               eval_split: str = "test", eval_size: int = 0, chat: bool = True,
               max_row_bytes: int = MAX_ROW_BYTES) -> GSM8KSplits:
    """Training items and (with eval_size > 0) the first `eval_size` held-out items (a local file's rows each at
    most `max_row_bytes`)."""
    local = path is not None and Path(path).exists()
    if local:
        rows, source = _local(Path(path), split, max_row_bytes)  # type: ignore[arg-type]
    elif path is not None and (path.startswith((".", "/")) or path.endswith((".jsonl", ".parquet"))):
        raise FileNotFoundError(f"data file {path} not found; set data.path to a GSM8K .jsonl/.parquet file or a "
                                "directory with train.jsonl")
    else:
        source = path or DATASET_NAME
        rows = _by_name(source, split, max_row_bytes)
    held: list[dict[str, Any]] = []
    if eval_size > 0:
        if eval_path is not None:
            held, _ = _local(Path(eval_path), eval_split, max_row_bytes)
        elif local and Path(path).is_dir() and _split_file(Path(path), eval_split) is not None:  # type: ignore[arg-type]
            held, _ = _local(Path(path), eval_split, max_row_bytes)  # type: ignore[arg-type]
        elif not local:
            held = _by_name(source, eval_split, max_row_bytes)
        else:  # one file: its tail is held out
            if len(rows) <= eval_size:
                raise ValueError(f"data.eval_size={eval_size} holds out every one of the {len(rows)} rows of {source}; "
                                 "lower data.eval_size or set data.eval_path to a held-out file")
            rows, held = rows[:-eval_size], rows[-eval_size:]
            logger.info("held out the last %d of %d rows of %s for evaluation", eval_size, len(rows) + eval_size, source)
        held = held[:eval_size]
    return GSM8KSplits([to_item(r, chat) for r in rows], [to_item(r, chat) for r in held], source)


def gsm8k_items(path: str | Path, split: str = "train", chat: bool = False) -> list[dict[str, Any]]:
    """GSM8K rows ({question, answer}) as items with a prompt; `path` is a file or a directory with <split>.jsonl."""
    return load_gsm8k(str(path), split, chat=chat).train
