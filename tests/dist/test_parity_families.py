"""DeepSeek-V3 and GLM-4.5-MoE Megatron parity on gloo, fp32, as tests/dist/test_parity.py does for Qwen3-MoE: at
one rank the logits equal transformers' and the HF export equals the source safetensors bit for bit (MLA low-rank
projections and their layernorms, shared experts, the router's correction bias, the dense first layer); at TP2
(+ sequence parallel), EP2 and PP2 (the dense layer on stage 0) the logits, the export and one training step equal
the single rank's. Slow: eight Megatron set-ups (two launches)."""
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mega_async.bridge.model_cards import TINY_DEEPSEEK, TINY_GLM, init_random_weights

sys.path.insert(0, str(Path(__file__).parent))
from test_parity import hf_logits, result, run_all  # noqa: E402

pytestmark = pytest.mark.slow

CARDS = {"deepseek": TINY_DEEPSEEK, "glm": TINY_GLM}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity-families")
    return {k: init_random_weights(card, root / k, seed=0) for k, card in CARDS.items()}


LAYOUTS = [(k, layout, 2) for k in CARDS for layout in ("megatron:t2", "megatron:d2e2", "megatron:p2")]


@pytest.fixture(scope="module")
def runs(weights, tmp_path_factory):
    """The two single-rank references and the six layouts, in two launches (jobs.run_jobs)."""
    cases = {f"{k}-d1": (k, "megatron:d1", 1, 1) for k in CARDS}
    cases.update({f"{k}-{layout}": (k, layout, n, 1) for k, layout, n in LAYOUTS})
    return run_all(weights, cases, tmp_path_factory.mktemp("runs-families"))


@pytest.fixture(scope="module")
def single_rank(runs):
    return {k: result(runs, f"{k}-d1") for k in CARDS}


def same_export(got: dict, src: dict) -> bool:
    return got.keys() == src.keys() and all(got[k].dtype == src[k].dtype and torch.equal(got[k], src[k]) for k in src)


@pytest.mark.parametrize("kind", list(CARDS))
def test_single_rank_matches_transformers_and_exports_exactly(weights, single_rank, kind):
    res = single_rank[kind]
    gap = (res["logits"]["logits"] - hf_logits(weights[kind])).abs().max().item()
    print(f"parity {kind} d1: |logits - transformers| max {gap:.2e}")
    assert gap < 1e-4, f"{kind}: logits differ from transformers' by {gap}"
    src = load_file(str(weights[kind] / "model.safetensors"))
    # the pieces of these families travel under their own HF names
    names = set(src)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names and "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in names
    if kind == "deepseek":
        assert {"model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.q_a_layernorm.weight",
                "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.self_attn.kv_a_layernorm.weight",
                "model.layers.0.self_attn.kv_b_proj.weight"} <= names
    else:
        assert "model.layers.0.self_attn.q_proj.bias" in names
    assert same_export(res["export"], src)
    assert src["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max() > 0  # a bias that routes
    moved = max((res["stepped"][k] - src[k]).abs().max().item() for k in src)
    assert moved > 1e-4  # the training step really changed the weights
    # the router's correction bias is the checkpoint's: RL does not update it (moe_router_bias_update_rate 0)
    for k in src:
        if k.endswith("e_score_correction_bias"):
            assert torch.equal(res["stepped"][k], src[k]), k


@pytest.mark.parametrize("kind, layout, nproc", LAYOUTS, ids=[f"{k}-{l.split(':')[1]}" for k, l, _ in LAYOUTS])
def test_layout_parity(weights, single_rank, runs, kind, layout, nproc):
    ref = single_rank[kind]
    res = result(runs, f"{kind}-{layout}")
    want = {"megatron:t2": (2, 1, 1), "megatron:d2e2": (1, 1, 2), "megatron:p2": (1, 2, 1)}[layout]
    assert (res["parallel"]["tp"], res["parallel"]["pp"], res["parallel"]["ep"]) == want  # as asked
    gap = (res["logits"]["logits"] - ref["logits"]["logits"]).abs().max().item()
    assert gap < 1e-4, f"{kind} {layout}: logits differ from one rank's by {gap}"
    src = load_file(str(weights[kind] / "model.safetensors"))
    assert same_export(res["export"], src)
    assert res["stepped"].keys() == ref["stepped"].keys()
    diff = max((res["stepped"][k] - ref["stepped"][k]).abs().max().item() for k in src)
    print(f"parity {kind} {layout}: |logits - one rank| max {gap:.2e}, stepped weights {diff:.2e}")
    assert diff < 1e-5, f"{kind} {layout}: updated weights differ from the single-rank step by {diff}"
