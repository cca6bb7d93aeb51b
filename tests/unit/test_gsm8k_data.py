"""GSM8K loading: local jsonl / parquet / directory, chat prompts through the tiny card's chat template,
the held-out split (file, directory split, or the data's tail kept out of training), one-line errors."""
import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mega_async.api.config import ConfigError
from mega_async.api.config_load import load_config
from mega_async.data.gsm8k import INSTRUCTION, load_gsm8k

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "tests" / "assets" / "gsm8k_train_head20.jsonl"
ROWS = [json.loads(x) for x in SAMPLE.read_text().splitlines()]


def test_chat_items_through_the_chat_template():
    s = load_gsm8k(str(SAMPLE))
    assert len(s.train) == 20 and s.heldout == []
    first = s.train[0]
    assert first["answer"] == ROWS[0]["answer"]
    assert first["messages"] == [{"role": "user", "content": f"{ROWS[0]['question']}\n{INSTRUCTION}"}]
    tok = AutoTokenizer.from_pretrained(ROOT / "models" / "tiny-qwen3-moe")
    text = tok.apply_chat_template(first["messages"], tokenize=False, add_generation_prompt=True)
    assert text == f"<|im_start|>user\n{ROWS[0]['question']}\n{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    plain = load_gsm8k(str(SAMPLE), chat=False).train[0]
    assert plain["prompt"].startswith(f"Question: {ROWS[0]['question']}") and "messages" not in plain


def test_heldout_tail_is_kept_out_of_training():
    s = load_gsm8k(str(SAMPLE), eval_size=5)
    assert [it["answer"] for it in s.train] == [r["answer"] for r in ROWS[:15]]
    assert [it["answer"] for it in s.heldout] == [r["answer"] for r in ROWS[15:]]
    with pytest.raises(ValueError, match="data.eval_size=20 holds out every one of the 20 rows"):
        load_gsm8k(str(SAMPLE), eval_size=20)


def test_directory_with_train_and_test_splits(tmp_path):
    shutil.copy(SAMPLE, tmp_path / "train.jsonl")
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]))
    s = load_gsm8k(str(tmp_path), eval_size=2)
    assert len(s.train) == 20  # a separate test split: nothing taken from training
    assert [it["answer"] for it in s.heldout] == [r["answer"] for r in ROWS[:2]]
    other = tmp_path / "held.jsonl"
    other.write_text(json.dumps(ROWS[7]) + "\n")
    s = load_gsm8k(str(SAMPLE), eval_path=str(other), eval_size=4)
    assert len(s.train) == 20 and [it["answer"] for it in s.heldout] == [ROWS[7]["answer"]]


def test_parquet(tmp_path):
    import pyarrow as pa  # the test extra installs it
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "train.parquet")
    s = load_gsm8k(str(tmp_path / "train.parquet"), eval_size=4)
    assert [it["answer"] for it in s.train + s.heldout] == [r["answer"] for r in ROWS]


def test_bad_inputs_are_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="data file .*missing.jsonl not found"):
        load_gsm8k(str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="has no train.jsonl or train.parquet"):
        load_gsm8k(str(tmp_path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match="row 0 answer has no '#### <number>' line"):
        load_gsm8k(str(bad))
    try:
        import datasets  # noqa: F401
    except ImportError:  # without `datasets` a dataset name is refused with the fix
        with pytest.raises(FileNotFoundError, match="needs the `datasets` package"):
            load_gsm8k(None)


def test_eval_keys_are_validated():
    with pytest.raises(ConfigError, match="trainer.eval_interval=-1 must be >= 0"):
        load_config(None, ["trainer.eval_interval=-1"])
    with pytest.raises(ConfigError, match="data.eval_size=0 must be > 0"):
        load_config(None, ["data.eval_size=0"])
    with pytest.raises(ConfigError, match="trainer.eval_interval=2 needs data.name=gsm8k"):
        load_config(None, ["trainer.eval_interval=2"])
    cfg = load_config(ROOT / "configs" / "gsm8k_tiny_cpu.yaml")
    assert cfg.trainer.eval_interval == 1 and cfg.data.eval_size == 4 and cfg.data.chat_template
