"""The countdown task (mega_async.data.countdown, reward.countdown): the long-tailed task of issue 35."""
import json
import statistics
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from mega_async.api.config import ConfigError
from mega_async.api.config_load import load_config
from mega_async.data import countdown as task
from mega_async.reward.countdown import countdown_reward
from mega_async.api.sft_config import load_sft_config
from mega_async.run.sft import task_items

CARD = "models/tiny-addition"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(CARD)


def test_items_round_trip_and_answers_are_the_worked_countdown(tok):
    assert task.answer_text(12, 9, 3) == "012,011,010,009" and task.prompt_text(12, 9, 3) == "012>009:"
    for it in task.countdown_items(200, 3, tok, seed=2):
        a, b = int(it["prompt"][:3]), int(it["prompt"][4:7])
        assert tok.decode(it["input_ids"]) == it["prompt"] and len(it["input_ids"]) == 8
        nums = [int(x) for x in it["answer"].split(",")]
        assert nums == list(range(a, b - 1, -1)) and it["count"] == a - b >= 1
        assert len(tok(it["answer"], add_special_tokens=False)["input_ids"]) >= len(it["answer"]) // 3  # BPE merges
        assert len(task.encode(it["answer"], task.char_ids(tok))) == (a - b + 1) * 4 - 1


def test_lengths_are_long_tailed():
    """Answers from a few tokens to a few hundred; in a batch of 8 prompts the longest is usually >= 3x the
    median (the long tail a synchronous step waits for)."""
    lens = [(a - b + 1) * 4 for a, b in task.problems(4096, 3, seed=1)]
    assert min(lens) == 8 and max(lens) == 300 and statistics.median(lens) <= 48
    ratios = [max(lens[i:i + 8]) / statistics.median(lens[i:i + 8]) for i in range(0, 4096, 8)]
    assert statistics.median(ratios) >= 3.0


def test_splits_are_disjoint_and_params_checked(tok):
    train = {task.prompt_text(a, b, 3) for a, b in task.problems(3000, 3, seed=0)}
    held = {task.prompt_text(a, b, 3) for a, b in task.problems(300, 3, seed=0, split="eval")}
    assert not train & held and task.problems(5, 3, seed=4) == task.problems(5, 3, seed=4)
    with pytest.raises(ValueError, match="max_count"):
        task.problems(5, 2, seed=0, max_count=100)


def test_reward_is_exact_match_of_the_whole_answer():
    assert countdown_reward("", " 012,011,010 ", answer="012,011,010") == 1.0
    assert countdown_reward("", "012,011,009", answer="012,011,010") == 0.0
    assert countdown_reward("", "012,011", answer="012,011,010") == 0.0  # stopped early


def test_sft_and_rl_configs_load(tok):
    cfg = load_sft_config("configs/countdown_sft_cpu.yaml")
    assert cfg.task.name == "countdown" and all("," in it["answer"] or it["count"] == 0
                                                 for it in task_items(cfg.task, 20, tok, 0, "train"))
    with pytest.raises(ConfigError, match="task.name='subtraction'"):
        load_sft_config(None, ["task.name=subtraction"])
    with pytest.raises(ConfigError, match="task.max_count=1000"):
        load_sft_config("configs/countdown_sft_cpu.yaml", ["task.max_count=1000"])
    rl = load_config("configs/countdown_rl_cpu.yaml")
    assert rl.rollout.max_new_tokens > 300 and rl.data.reward.endswith("countdown_reward")
    # it starts from the shipped SFT model, which is there and is the task's (its prompts are countdown problems)
    assert Path(rl.model.path, "model.safetensors").is_file() and Path(rl.data.path).is_file()
    row = json.loads(Path(rl.data.path).read_text().splitlines()[0])
    a, b = row["prompt"].rstrip(":").split(">")
    nums = row["answer"].split(",")
    assert tok.decode(row["input_ids"]) == row["prompt"] and (nums[0], nums[-1]) == (a, b)
