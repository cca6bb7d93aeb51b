"""Parsers of completions and dataset rows: linear in their input, same answers as before on normal input."""
import json
import random
import re
import time
from pathlib import Path

import pytest

from mega_async.rollout.agent import parse_tool_calls, tool_call_spans

ROOT = Path(__file__).resolve().parents[2]

_OLD_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)  # the quadratic regex it replaces


def _old_parse_tool_calls(text):
    calls = []
    for i, body in enumerate(_OLD_TOOL_CALL.findall(text)):
        try:
            obj = json.loads(body)
            name, args = obj["name"], obj.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        calls.append({"index": i, "type": "function",
                      "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return (_OLD_TOOL_CALL.sub("", text).strip() if calls else text), calls


PIECES = ["<tool_call>", "</tool_call>", "<tool_call", "tool_call>", "</tool_call", "<", ">", "/", " ", "\n", "\t",
          "\u3000", "\x1c", "\u2028", "x", "{", "}", '"', '{"name": "f"}', '{"name": "g", "arguments": {"a": 1}}',
          '{"name": "h", "arguments": "raw"}', '{"arguments": {}}', "[1]", "null", "é",
          '<tool_call>{"name": "f"}</tool_call>', '<tool_call>\n {"name": "g", "arguments": {"a": 1}} \u3000</tool_call>']


def test_tool_calls_match_the_regex_on_random_text():
    rng = random.Random(0)
    for _ in range(4000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30)))
        assert [(m.start(), m.end(), m.group(1)) for m in _OLD_TOOL_CALL.finditer(text)] == tool_call_spans(text), text
        content, calls = parse_tool_calls(text)
        for c in calls:
            assert c.pop("id").startswith("call_")
        assert (content, calls) == _old_parse_tool_calls(text), text


def test_tool_calls_are_linear_in_the_completion():
    # before: 88 KB of unclosed <tool_call> took 21 s on the event loop (each opening rescanned the rest);
    # 1.1 MB here would have taken about an hour. Each is a single pass now.
    for text in ("<tool_call>" * 100_000, "<tool_call>" + " " * 1_000_000 + "x",
                 ("<tool_call>" + " " * 50 + "x") * 20_000 + "</tool_call>"):
        t0 = time.monotonic()
        content, calls = parse_tool_calls(text)
        assert calls == [] and content == text
        assert time.monotonic() - t0 < 5.0


def test_tool_call_json_nested_too_deep_is_left_in_the_content():
    text = "<tool_call>" + "[" * 100_000 + "</tool_call>"  # json.loads raises RecursionError, not a decode error
    assert parse_tool_calls(text) == (text, [])
    text = '<tool_call>{"name": 5}</tool_call>'  # OpenAI's function.name is a string
    assert parse_tool_calls(text) == (text, [])


ROWS = [  # (jsonl line, what the one-line refusal says) for rows a dataset should not hold
    ("[1, 2]", ":1: a row must be a JSON object, got list"),
    ('"question answer ####"', ":1: a row must be a JSON object, got str"),
    ("[" * 100_000, ":1: invalid JSON (nested deeper than the parser goes)"),  # was a RecursionError traceback
    ('{"input_ids": [' + "9" * 5000 + "]}", ":1: invalid JSON (Exceeds the limit (4300 digits)"),
]
ITEMS = [  # rows the rlvr / multi_turn workflows cannot encode (each failed every episode before)
    ('{"input_ids": ["x"]}', "row 0: input_ids must be a non-empty list of token ids in [0, 64)"),
    ('{"input_ids": [64]}', "row 0: input_ids must be a non-empty list of token ids in [0, 64)"),
    ('{"input_ids": [true]}', "row 0: input_ids must be a non-empty list of token ids in [0, 64)"),
    ('{"messages": "hi"}', "row 0: messages must be a non-empty list of {role, content} objects"),
    ('{"prompt": 5}', "row 0: prompt must be a string, got int"),
    ('{"question": "q", "answer": "#### 1"}', "row 0 has no input_ids, prompt or messages"),
]
GSM8K_ROWS = [
    ('5', ":1: a row must be a JSON object, got int"),  # was a TypeError traceback
    ('{"question": {"a": 1}, "answer": ["####"]}', "row 0: 'question' and 'answer' must be strings"),
]


def _refusal(tmp_path, line, load):
    path = tmp_path / "rows.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError) as e:
        load(path)
    return str(e.value)


def test_malformed_dataset_rows_are_refused_in_one_line(tmp_path):
    from mega_async.data import check_items, load_rows
    from mega_async.data.gsm8k import load_gsm8k

    for line, expect in ROWS:
        msg = _refusal(tmp_path, line, load_rows)
        assert expect in msg and "\n" not in msg and str(tmp_path) in msg, msg
    for line, expect in ITEMS:
        msg = _refusal(tmp_path, line, lambda p: check_items(load_rows(p), str(p), 64))
        assert expect in msg and "\n" not in msg, msg
    for line, expect in GSM8K_ROWS:
        msg = _refusal(tmp_path, line, lambda p: load_gsm8k(str(p)))
        assert expect in msg and "\n" not in msg, msg
    good = tmp_path / "good.jsonl"
    good.write_text('{"input_ids": [1, 63]}\n{"prompt": "p"}\n{"messages": [{"role": "user", "content": "c"}]}\n')
    assert len(check_items(load_rows(good), str(good), 64)) == 3


def test_the_run_refuses_them_before_it_starts(tmp_path):
    from mega_async.api.config import ConfigError
    from mega_async.api.config_load import load_config
    from mega_async.run.loop import check_inputs

    path = tmp_path / "rows.jsonl"
    path.write_text('{"input_ids": [1, 2]}\n{"input_ids": [1000000]}\n')
    cfg = load_config(str(ROOT / "configs" / "tiny_cpu.yaml"), ["data.name=jsonl", f"data.path={path}", "data.reward=synthetic",
                                                             f"model.path={ROOT / 'models' / 'tiny-qwen3-moe'}"])
    with pytest.raises(ConfigError, match=r"row 1: input_ids must be a non-empty list of token ids in \[0, "):
        check_inputs(cfg)
