"""The addition task (mega_async.data.addition, reward.addition), the SFT loss and the SFT config/batch."""
import math

import pytest
import torch
from transformers import AutoTokenizer

from mega_async.algo.loss import sft_loss
from mega_async.api.config import ConfigError
from mega_async.data import addition as task
from mega_async.reward.addition import addition_reward
from mega_async.api.sft_config import load_sft_config
from mega_async.run.sft import sft_batch

CARD = "models/tiny-addition"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(CARD)


def test_every_character_is_one_token_and_items_round_trip(tok):
    ids = task.char_ids(tok)
    assert len(set(ids.values())) == len(task.CHARS)
    items = task.addition_items(50, 3, tok, seed=3)
    for it in items:
        a, b = int(it["prompt"][:3]), int(it["prompt"][4:7])
        assert it["prompt"] == task.prompt_text(a, b, 3) and len(it["input_ids"]) == 8
        assert tok.decode(it["input_ids"]) == it["prompt"]
        assert int(it["answer"]) == a + b  # the sum, most significant digit first, no padding
    # the BPE merges digit pairs ("12" is one token): the task never lets it, the tokenizer would
    assert len(tok("123+456=", add_special_tokens=False)["input_ids"]) < 8


def test_splits_are_disjoint_and_seeded(tok):
    train = set(task.problems(3000, 2, seed=1, split="train"))
    held = set(task.problems(300, 2, seed=0, split="eval"))
    assert not train & held and len(held) > 100
    assert task.problems(20, 3, seed=5) == task.problems(20, 3, seed=5) != task.problems(20, 3, seed=6)
    with pytest.raises(ValueError, match="split"):
        task.problems(1, 3, 0, split="test")


def test_sft_example_masks_answer_and_eos(tok):
    it = task.addition_items(1, 3, tok, seed=0)[0]
    ids, mask = task.sft_example(it, task.char_ids(tok), tok.eos_token_id)
    n = len(it["answer"]) + 1
    assert ids[-1] == tok.eos_token_id and mask == [0] * 8 + [1] * n
    assert tok.decode(ids[8:-1]) == it["answer"]


def test_reward_is_exact_match():
    assert addition_reward("123+456=", "579", answer="579") == 1.0
    assert addition_reward("123+456=", " 579\n", answer="579") == 1.0
    for wrong in ("578", "5790", "57", "", "579 9"):
        assert addition_reward("123+456=", wrong, answer="579") == 0.0


def test_sft_loss_is_cross_entropy_of_the_masked_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])
    logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    loss, st = sft_loss(logp, mask)
    ref = torch.nn.functional.cross_entropy(logits[mask.bool()], labels[mask.bool()])
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6) and st["nll"].item() == pytest.approx(ref.item())
    total, _ = sft_loss(logp, mask, denominator=1.0)
    assert total.item() == pytest.approx(ref.item() * 6, rel=1e-6)
    loss.backward()
    assert logits.grad[0, :2].abs().sum() == 0 and logits.grad[0, 2].abs().sum() > 0
    _, st = sft_loss(torch.full((1, 3), math.log(0.6)), torch.tensor([[1, 1, 0]]))
    assert st["likely_frac"].item() == 1.0


def test_label_smoothing_is_torchs():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, generator=g)
    labels = torch.randint(0, 7, (3,), generator=g)
    all_lp = torch.log_softmax(logits, -1)
    loss, st = sft_loss(all_lp.gather(-1, labels[:, None])[:, 0], torch.ones(3), label_smoothing=0.25,
                        mean_logprobs=all_lp.mean(-1))
    ref = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.25)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert st["nll"].item() == pytest.approx(torch.nn.functional.cross_entropy(logits, labels).item(), rel=1e-6)
    with pytest.raises(ValueError, match="mean_logprobs"):
        sft_loss(all_lp[:, 0], torch.ones(3), label_smoothing=0.1)


def test_sft_batch_layout():
    b = sft_batch([([5, 6, 7, 0], [0, 0, 1, 1]), ([5, 6, 0], [0, 1, 1])])
    assert b["input_ids"].tolist() == [[5, 6, 7, 0], [5, 6, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert b["loss_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 1, 0]]
    assert b["advantages"].shape == (2,) and b["logprobs"].shape == (2, 4)


def test_sft_config_validation(tmp_path):
    cfg = load_sft_config("configs/addition_sft_cpu.yaml", ["trainer.total_steps=5", "trainer.warmup_steps=1"])
    assert cfg.trainer.total_steps == 5 and cfg.model.path == CARD
    with pytest.raises(ConfigError, match="trainer.warmup_steps"):
        load_sft_config(None, ["trainer.total_steps=5", "trainer.warmup_steps=5"])
    with pytest.raises(ConfigError, match="task.digits"):
        load_sft_config(None, ["task.digits=0"])
    with pytest.raises(ConfigError, match="trainer.stepz"):
        load_sft_config(None, ["trainer.stepz=3"])
    with pytest.raises(ConfigError, match="not found"):
        load_sft_config(str(tmp_path / "missing.yaml"))
