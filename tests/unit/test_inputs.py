"""Inputs checked before anything starts: one line, exit 2, no run directory written."""
from pathlib import Path

import pytest

from mega_async.cli import main
from mega_async.api.config import ConfigError
from mega_async.api.config_load import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


def train(tmp_path, capsys, *overrides, resume=False):
    rc = main(["train", "-c", TINY, f"logging.root_dir={tmp_path / 'runs'}", *overrides] + (["--resume"] if resume else []))
    return rc, capsys.readouterr().err.strip()


def test_generation_budget_over_the_context_is_refused(tmp_path, capsys):
    rc, err = train(tmp_path, capsys, "rollout.max_new_tokens=5000")
    assert rc == 2 and "\n" not in err
    assert "rollout.max_new_tokens=5000 + data.max_prompt_tokens=256 = 5256 exceeds the model's context " \
           "max_position_embeddings=4096" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("content, expect", [
    (None, "not found"),
    ('{"prompt": "a"}\n{"prompt": oops}\n', "invalid JSON"),
])
def test_dataset_missing_or_unparsable_is_refused(tmp_path, capsys, content, expect):
    path = tmp_path / "data.jsonl"
    if content is not None:
        path.write_text(content)
    rc, err = train(tmp_path, capsys, "data.name=jsonl", f"data.path={path}", "data.reward=gsm8k")
    assert rc == 2 and "\n" not in err and f"data.path={path}" in err and expect in err
    assert not (tmp_path / "runs").exists()


def test_a_jsonl_dataset_must_name_its_reward():
    with pytest.raises(ConfigError, match="data.name=jsonl needs data.reward"):
        load_config(None, ["data.name=jsonl", "data.path=x.jsonl"])
    with pytest.raises(ConfigError, match="data.reward='nope'"):
        load_config(None, ["data.reward=nope"])
    assert load_config(None, ["data.name=jsonl", "data.path=x.jsonl", "data.reward=pkg.mod:fn"]).data.reward


def test_unknown_reward_function_is_refused(tmp_path, capsys):
    rc, err = train(tmp_path, capsys, "data.reward=no_such_module:fn")
    assert rc == 2 and "data.reward='no_such_module:fn': cannot load it" in err


def test_existing_run_is_not_mixed_with_a_new_one(tmp_path, capsys):
    run = tmp_path / "runs" / "tiny_cpu" / "run0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    rc, err = train(tmp_path, capsys)
    assert rc == 2 and "\n" not in err and "already holds a run (metrics.jsonl): pass --resume" in err
    rc, err = train(tmp_path, capsys, resume=True)
    assert rc == 2 and "--resume: no complete checkpoint under" in err
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'  # untouched


def test_prompts_over_the_budget_are_skipped():
    from mega_async.run.loop import within_prompt_budget
    from mega_async.rollout.workflow import RLVRWorkflow

    cfg = load_config(None, ["data.max_prompt_tokens=4"])
    wf = RLVRWorkflow(lambda *a, **k: 0.0)
    items = [{"input_ids": [1] * n} for n in (2, 4, 5, 9)]
    assert [len(i["input_ids"]) for i in within_prompt_budget(items, wf, cfg)] == [2, 4]
    with pytest.raises(ConfigError, match="every prompt is longer than data.max_prompt_tokens=4"):
        within_prompt_budget(items[2:], wf, cfg)
