"""Multi-turn workflow: feedback turns as chat-template token ids, per-turn discount, loss mask, versions."""
import asyncio

import pytest
from transformers import AutoTokenizer

from mega_async.rollout import chat
from mega_async.rollout.workflow import MultiTurnWorkflow
from mega_async.api.types import ModelRequest, ModelResponse

CARD = "models/tiny-qwen3-moe"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(CARD)


class ScriptedEngine:
    """Answers call k with turns[k]: (tokens, logprobs, versions); records every request."""

    def __init__(self, turns):
        self.turns, self.requests = list(turns), []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests.append(req)
        toks, lps, vs = self.turns[len(self.requests) - 1]
        return ModelResponse(list(req.input_ids), list(toks), list(lps), list(vs), "stop")


def scripted_reward(answers):
    """Reward 1 when the completion is the right answer, else 0; records each completion."""
    seen = []

    def reward(prompt, completion, answer, **_):
        seen.append(completion)
        return 1.0 if completion.strip() == answer else 0.0

    reward.seen = seen
    return reward


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_feedback_turn_is_the_template_delta_and_only_model_tokens_train(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    wrong = ids(tok, "seven") + [im_end]  # stops on the template's end of turn
    right = ids(tok, "eight")  # stops by length: no end token
    # the second turn was interrupted once: its tokens carry versions 3 then 4
    eng = ScriptedEngine([(wrong, [-0.1] * len(wrong), [3] * len(wrong)),
                          (right, [-0.2] * len(right), [3] + [4] * (len(right) - 1))])
    reward = scripted_reward(["eight"])
    wf = MultiTurnWorkflow(reward, tok, max_turns=3, turn_discount=0.5, feedback="Wrong, try again.",
                           max_new_tokens=8)
    msgs = [{"role": "user", "content": "4 + 4 = ?"}]
    t = asyncio.run(wf.arun_episode(eng, {"messages": msgs, "answer": "eight"}))
    # the whole sequence is what the chat template renders for the conversation, token for token
    convo = msgs + [{"role": "assistant", "content": "seven"}, {"role": "user", "content": "Wrong, try again."}]
    expect_prompt2 = ids(tok, tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True))
    assert eng.requests[1].input_ids == expect_prompt2
    assert t["input_ids"][0].tolist() == expect_prompt2 + right
    assert reward.seen == ["seven", "eight"]
    assert t["rewards"].tolist() == [0.5]  # right on the second turn: one discount
    p1 = len(eng.requests[0].input_ids)
    mask = t["loss_mask"][0].tolist()
    assert mask == [0] * p1 + [1] * len(wrong) + [0] * (len(expect_prompt2) - p1 - len(wrong)) + [1] * len(right)
    vers, lps = t["versions"][0].tolist(), t["logprobs"][0].tolist()
    assert [v for v, m in zip(vers, mask) if m] == [3] * len(wrong) + [3] + [4] * (len(right) - 1)
    assert [v for v, m in zip(vers, mask) if not m] == [-1] * (len(mask) - sum(mask))
    assert [round(x, 6) for x, m in zip(lps, mask) if m] == [-0.1] * len(wrong) + [-0.2] * len(right)
    assert im_end in wf.stop_token_ids  # the template's end of turn stops a turn


def test_generated_tokens_are_never_retokenized(tok):
    # two tokens whose decoded text re-encodes differently (e.g. "t" "he" -> "the"): the trajectory keeps them
    a, b = next((x, y) for x in range(300, 400) for y in range(300, 400)
                if ids(tok, tok.decode([x, y])) != [x, y])
    eng = ScriptedEngine([([a, b], [-1.0, -1.0], [0, 0]), ([a], [-1.0], [1])])
    wf = MultiTurnWorkflow(lambda p, c, **_: 0.0, tok, max_turns=2, max_new_tokens=4)
    t = asyncio.run(wf.arun_episode(eng, {"prompt": "hi"}))
    p1 = len(eng.requests[0].input_ids)
    assert t["input_ids"][0, p1:p1 + 2].tolist() == [a, b]
    assert eng.requests[1].input_ids[:p1 + 2] == eng.requests[0].input_ids + [a, b]
    assert t["rewards"].tolist() == [0.0] and len(eng.requests) == 2  # wrong both times: max_turns tries


def test_right_first_time_is_one_turn_and_failed_reward_rejects(tok):
    eight = ids(tok, "eight")
    eng = ScriptedEngine([(eight, [-0.3] * len(eight), [0] * len(eight))])
    wf = MultiTurnWorkflow(scripted_reward(["eight"]), tok, max_turns=3, max_new_tokens=8)
    t = asyncio.run(wf.arun_episode(eng, {"prompt": "4 + 4 = ?", "answer": "eight"}))
    assert t["rewards"].tolist() == [1.0] and len(eng.requests) == 1

    def broken(prompt, completion, **_):
        raise RuntimeError("reward crashed")

    eng = ScriptedEngine([([5], [-1.0], [0])])
    assert asyncio.run(MultiTurnWorkflow(broken, tok).arun_episode(eng, {"prompt": "x"})) is None


def test_context_limit_stops_turns_and_token_only_feedback(tok):
    eng = ScriptedEngine([([5, 6], [-1.0, -1.0], [0, 0])] * 3)
    wf = MultiTurnWorkflow(lambda p, c, **_: 0.0, None, max_turns=3, feedback_ids=[9, 9], max_new_tokens=2,
                           max_context=9)
    t = asyncio.run(wf.arun_episode(eng, {"input_ids": [1, 2]}))
    # turn 1: 2 + 2 = 4 tokens; turn 2 would need 4 + 2 + 2 = 8 <= 9; turn 3 would need 8 + 2 + 2 > 9
    assert t["input_ids"][0].tolist() == [1, 2, 5, 6, 9, 9, 5, 6] and len(eng.requests) == 2
    assert t["loss_mask"][0].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="chat template, or feedback_ids"):
        MultiTurnWorkflow(lambda p, c, **_: 0.0, None, max_turns=2)
    with pytest.raises(ValueError, match="turn_discount"):
        MultiTurnWorkflow(lambda p, c, **_: 0.0, tok, turn_discount=0)


def test_chat_helpers(tok):
    assert chat.assistant_close_text(tok) == "<|im_end|>\n"
    assert chat.end_of_turn_id(tok) == tok.convert_tokens_to_ids("<|im_end|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert chat.close_ids(tok, [5, im_end]) == ids(tok, "\n")  # the model's own stop token is not repeated
    assert chat.close_ids(tok, [5]) == [im_end] + ids(tok, "\n")  # a length stop gets the whole closing
    assert tok.decode(chat.turn_ids(tok, [{"role": "user", "content": "more"}])) == \
        "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"


class EchoWorkflow(MultiTurnWorkflow):
    pass


def factory(cfg, tokenizer, reward_fn):
    return EchoWorkflow(reward_fn, tokenizer, max_turns=cfg.rollout.max_turns)


def test_make_workflow_reads_rollout_workflow(tok):
    from mega_async.api.config_load import load_config
    from mega_async.rollout.workflow import RLVRWorkflow, make_workflow

    def r(p, c, **_):
        return 0.0

    assert type(make_workflow(load_config(), tok, r)) is RLVRWorkflow
    mt = make_workflow(load_config(overrides=["rollout.workflow=multi_turn", "rollout.max_turns=5",
                                              "rollout.turn_discount=0.7"]), tok, r)
    assert isinstance(mt, MultiTurnWorkflow) and (mt.max_turns, mt.turn_discount, mt.max_context) == (5, 0.7, 4096)
    own = make_workflow(load_config(overrides=["rollout.workflow=tests.unit.test_workflow_multiturn:factory",
                                               "rollout.max_turns=2"]), tok, r)
    assert type(own) is EchoWorkflow and own.max_turns == 2
    with pytest.raises(ValueError, match="cannot load it"):
        make_workflow(load_config(overrides=["rollout.workflow=tests.unit.nothing_here:factory"]), tok, r)


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.workflow=multi_turn", "inference.backend=simulated"], "no tokenizer"),
    (["rollout.workflow=my-task"], "rollout.workflow"),
    (["rollout.max_turns=0"], "rollout.max_turns"),
    (["rollout.turn_discount=1.5"], "rollout.turn_discount"),
    (["algorithm.objective=seq"], "algorithm.objective"),
    (["algorithm.imp_weight_mode=kpop"], "algorithm.imp_weight_mode"),
    (["algorithm.imp_weight_bounds=[5,0.5]"], "algorithm.imp_weight_bounds"),
    (["algorithm.imp_weight_mode=tis", "algorithm.behav_imp_weight_cap=null"], "behav_imp_weight_cap"),
    (["algorithm.objective=gspo", "parallel.allocation=sglang:d1+megatron:c2"], "context parallelism"),
])
def test_workflow_and_objective_keys_are_validated(overrides, needle):
    from mega_async.api.config import ConfigError
    from mega_async.api.config_load import load_config

    with pytest.raises(ConfigError, match=needle):
        load_config(overrides=overrides)


def test_code_multiturn_config_wires_the_workflow_reward_and_objective(tok):
    from mega_async.api.config_load import load_config
    from mega_async.run.loop import reward_for
    from mega_async.reward.code import code_reward
    from mega_async.rollout.workflow import make_workflow

    cfg = load_config("configs/code_multiturn_cpu.yaml")
    assert reward_for(cfg) is code_reward
    wf = make_workflow(cfg, tok, reward_for(cfg))
    assert isinstance(wf, MultiTurnWorkflow) and (wf.max_turns, wf.turn_discount) == (3, 0.9)
    assert (cfg.algorithm.imp_weight_mode, list(cfg.algorithm.imp_weight_bounds)) == ("icepop", [0.5, 5.0])
