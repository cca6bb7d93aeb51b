"""Parsers of completions and dataset rows: linear in their input, same answers as before on normal input."""
import json
import random
import re
import time

from mega_async.rollout.agent import parse_tool_calls, tool_call_spans

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
