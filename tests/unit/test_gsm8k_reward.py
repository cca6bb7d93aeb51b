import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from mega_async.data.gsm8k import gsm8k_items
from mega_async.reward.gsm8k import gold_answer, gsm8k_reward

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "tests" / "assets" / "gsm8k_train_head20.jsonl"  # shipped: no ../shared needed


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


HOSTILE = ["The answer is 9^9^9^9", "So it is \\boxed{9^{9^{9}}}."]


def test_hostile_completions_score_zero_and_the_trainer_keeps_running():
    """Before: math-verify's sympy ran without end on these in the reward thread, holding the GIL (a 10 ms
    ticker never ran in 100 s). Now each scores 0.0 within the bound while this process's threads run on.
    In a child process, so that a regression fails (times out) instead of freezing pytest."""
    script = textwrap.dedent(f"""
        import json, sys, threading, time
        sys.path.insert(0, {str(ROOT)!r})
        from mega_async.reward import gsm8k
        assert gsm8k.gsm8k_reward("q", "The answer is 72", "#### 72") == 1.0  # workers up
        out, ticks = {{}}, []
        def score(c):
            t0 = time.monotonic()
            out[c] = (gsm8k.gsm8k_reward("q", c, "#### 72"), time.monotonic() - t0)
        threads = [threading.Thread(target=score, args=(c,)) for c in {HOSTILE!r}]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            ticks.append(1)
            time.sleep(0.01)
        print(json.dumps({{"out": out, "ticks": len(ticks), "bound": 3 * gsm8k.TIMEOUT}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout)
    assert [res["out"][c][0] for c in HOSTILE] == [0.0, 0.0]
    assert all(res["out"][c][1] < res["bound"] for c in HOSTILE), res
    assert res["ticks"] >= 10, res  # the ticker ran while math-verify worked
