import pytest
"""Evaluation on a real embedded server: greedy pass@1 equals what a transformers greedy decode scores,
only on evaluation steps, and a failing reward scores 0 (counted)."""
import torch
from transformers import AutoTokenizer

from mega_async.run.evaluation import Evaluator
from mega_async.inference.client import SGLangClient

pytestmark = pytest.mark.slow  # starts servers or trainer ranks: CI's second step keeps the default suite under 20 minutes on 2 cores

PROMPTS = ["Question: 2 + 3 = ?", "Natalia sold clips", "How many apples", "The answer is"]


def exact(prompt, completion, answer, **_):
    if answer == "raise":
        raise RuntimeError("broken reward")
    return float(completion == answer)


def hf_greedy(model, tok, prompt: str, n: int) -> tuple[str, int]:
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    if tok.eos_token_id in out:  # the server returns the stop token too; its text is skipped when decoding
        out = out[: out.index(tok.eos_token_id) + 1]
    return tok.decode(out, skip_special_tokens=True), len(out)


def test_greedy_pass_at_1_on_the_server(server, weights_root, hf_models):
    tok = AutoTokenizer.from_pretrained(weights_root / "v0")
    ref = [hf_greedy(hf_models["v0"], tok, p, 8) for p in PROMPTS]
    items = [{"prompt": PROMPTS[0], "answer": ref[0][0]}, {"prompt": PROMPTS[1], "answer": ref[1][0]},
             {"prompt": PROMPTS[2], "answer": ref[2][0] + " (not it)"}, {"prompt": PROMPTS[3], "answer": "raise"}]
    ev = Evaluator(items, SGLangClient(server.addresses), tok, exact, interval=2, max_new_tokens=8)
    assert ev.maybe_evaluate(0) == {} and ev.maybe_evaluate(2) == {}
    stats = ev.maybe_evaluate(1)
    assert stats["eval/pass@1"] == 0.5 and stats["eval/problems"] == 4  # 2 of 4 match the reference decode
    assert stats["eval/reward_failures"] == 1
    assert stats["eval/output_tokens_mean"] == sum(n for _, n in ref) / 4
    assert ev.evaluate()["eval/pass@1"] == 0.5  # greedy: the same again
