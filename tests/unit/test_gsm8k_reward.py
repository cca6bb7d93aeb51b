import json
import threading
from pathlib import Path

import pytest

from mega_async.data import gsm8k_items
from mega_async.reward.gsm8k import gold_answer, gsm8k_reward

SAMPLE = Path(__file__).resolve().parents[1] / "assets" / "gsm8k_train_head20.jsonl"  # shipped: no ../shared needed


def test_reward_values():
    a = "48/2 = 24\n#### 1,072"
    assert gold_answer(a) == "1072"
    assert gsm8k_reward("q", "So the total is \\boxed{1072}.", a) == 1.0
    assert gsm8k_reward("q", "The answer is 1072", a) == 1.0
    assert gsm8k_reward("q", "The answer is 17", a) == 0.0
    assert gsm8k_reward("q", "I do not know", a) == 0.0
    with pytest.raises(ValueError, match="####"):
        gsm8k_reward("q", "1", "no marker")


def test_reward_in_worker_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(gsm8k_reward("q", "answer: 72", "#### 72")))
    t.start()
    t.join()
    assert out == [1.0]


def test_reference_solutions_score_one():
    rows = [json.loads(line) for line in SAMPLE.open()]
    assert len(rows) == 20
    assert all(gsm8k_reward(r["question"], r["answer"].split("####")[0] + " The answer is " + gold_answer(r["answer"]),
                            r["answer"]) == 1.0 for r in rows)


def test_gsm8k_items_build_prompts():
    items = gsm8k_items(SAMPLE)
    assert len(items) == 20 and all(it["prompt"].startswith("Question: ") and "####" in it["answer"] for it in items)
