import json
import threading
from pathlib import Path

import pytest

from mega_async.reward.gsm8k import gold_answer, gsm8k_reward

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "train.jsonl"


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
    rows = [json.loads(line) for line in SHARED.open().readlines()[:20]]
    assert all(gsm8k_reward(r["question"], r["answer"].split("####")[0] + " The answer is " + gold_answer(r["answer"]),
                            r["answer"]) == 1.0 for r in rows)
