"""docs/rollout.md's "Write your own workflow" example runs as written, through rollout.workflow=my_task:make."""
import asyncio
import re
import sys
from pathlib import Path

from transformers import AutoTokenizer

from mega_async.api.config_load import load_config
from mega_async.rollout.workflow import make_workflow
from mega_async.api.types import ModelRequest, ModelResponse

ROOT = Path(__file__).parents[2]


class Scripted:
    def __init__(self, outputs):
        self.outputs, self.requests = outputs, []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        out = self.outputs[len(self.requests)]
        self.requests.append(req)
        return ModelResponse(list(req.input_ids), out, [-0.5] * len(out), [len(self.requests)] * len(out), "stop")


def test_docs_workflow_example(tmp_path, monkeypatch):
    text = (ROOT / "docs" / "rollout.md").read_text()
    section = text.split("## Write your own workflow", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    (tmp_path / "my_task.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_task", None)
    tok = AutoTokenizer.from_pretrained(ROOT / "models" / "tiny-qwen3-moe")
    cfg = load_config(overrides=["rollout.workflow=my_task:make", "rollout.max_new_tokens=8"])
    wf = make_workflow(cfg, tok, reward_fn=None)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    four = tok("4", add_special_tokens=False)["input_ids"]
    eng = Scripted([[300, 301, im_end], four + [im_end]])
    t = asyncio.run(wf.arun_episode(eng, {"prompt": "2 + 2?", "answer": "4"}))
    assert t["rewards"].tolist() == [1.0]
    r0, r1 = eng.requests
    assert r1.input_ids[:len(r0.input_ids) + 3] == r0.input_ids + [300, 301, im_end] and r0.max_new_tokens == 8
    assert t["input_ids"][0].tolist() == r1.input_ids + four + [im_end]
    assert int(t["loss_mask"].sum()) == 3 + len(four) + 1
    assert sorted(set(t["versions"][0][t["loss_mask"][0].bool()].tolist())) == [1, 2]
