"""The resharder (gloo, fp32): at TP2, EP2, PP2, TP2+EP2 and VPP2 its buckets, joined over the pipeline
stages, equal the unsharded HF export bit for bit; each stage sends only its own layers under global
layer numbers; buckets keep to the byte budget, never split a layer's experts, and only stage heads
receive anything (no rank holds the whole model)."""
import json
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mega_async.bridge.model_cards import init_random_weights
from tests.dist.jobs import run_jobs

BUDGET = 48 << 10  # the tiny MoE is about 1.5 MiB: dozens of buckets


@pytest.fixture(scope="module")
def moe(tiny_weights):
    return tiny_weights["moe"]


def stages_of(out: Path) -> dict:
    stages = sorted(out.glob("stage*.json"))
    return {int(p.stem[5:]): (load_file(str(p.with_suffix(".safetensors"))), json.loads(p.read_text())) for p in stages}


def resharder_job(model: Path, layout: str, out: Path) -> list[str]:
    return ["resharder_worker.py", "--model", str(model), "--layout", layout, "--out", str(out),
            "--bucket-bytes", str(BUDGET)]


def reshard_all(runs: dict, out: Path) -> dict:
    """{name: (model, layout, nproc)} -> {name: (stages, error)}: one launch per rank count (jobs.run_jobs)."""
    results = {}
    for nproc in sorted({n for _, _, n in runs.values()}):
        jobs = {name: resharder_job(model, layout, out / name) for name, (model, layout, n) in runs.items()
                if n == nproc}
        errors = run_jobs(nproc, jobs, out / f"launch{nproc}")
        results.update({name: (stages_of(out / name), errors[name]) for name in jobs})
    return results


LAYOUTS = {"tp2": ("megatron:t2", 2, dict(tp=2, ep=1, pp=1, vpp=1)),
           "ep2": ("megatron:d2e2", 2, dict(tp=1, ep=2, pp=1, vpp=1)),
           "pp2": ("megatron:p2", 2, dict(tp=1, ep=1, pp=2, vpp=1)),
           "tp2-ep2": ("megatron:d2t2e2", 4, dict(tp=2, ep=2, pp=1, vpp=1)),
           "vpp2": ("megatron:p2v2", 2, dict(tp=1, ep=1, pp=2, vpp=2))}


def dist_jobs(weights: dict, out: Path) -> dict:
    """The default layouts' resharder runs (run by conftest's dist_runs, with other modules' jobs)."""
    return {name: (n, resharder_job(weights["moe"], layout, out / name)) for name, (layout, n, _) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def resharded(dist_runs):
    out = dist_runs.out(__name__)
    return {name: (stages_of(out / name), error) for name, error in dist_runs.of(__name__).items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_buckets_equal_unsharded_export(moe, resharded, name):
    layout, _, par = LAYOUTS[name]
    pp = par["pp"]
    stages, error = resharded[name]
    assert error is None, error
    src = load_file(str(moe / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in src.values())
    assert sorted(stages) == list(range(pp)), "one head per pipeline stage sends"
    got = {}
    for stage, (tensors, info) in stages.items():
        assert {k: info[k] for k in ("tp", "ep", "vpp")} == {k: par[k] for k in ("tp", "ep", "vpp")}  # as asked
        assert not set(tensors) & set(got), "a tensor was sent by two stages"
        got.update(tensors)
        assert info["max_bucket_bytes"] < total  # no rank holds the whole model
        seen_expert_layers = {}
        for i, b in enumerate(info["buckets"]):
            experts = {int(re.match(r"model\.layers\.(\d+)\.", n)[1]) for n in b["names"] if ".mlp.experts." in n}
            for layer in experts:
                assert layer not in seen_expert_layers, f"layer {layer}'s experts split over buckets"
                seen_expert_layers[layer] = i
            if b["nbytes"] > BUDGET:  # only a single unit may exceed the budget
                assert len(experts) == 1 and all(".mlp.experts." in n for n in b["names"]) or len(b["names"]) == 1
    assert got.keys() == src.keys()
    for k in src:
        assert got[k].dtype == src[k].dtype and got[k].equal(src[k]), k
    if pp == 2:
        first = {n for n in stages[0][0] if n.startswith("model.layers.")}
        assert "model.embed_tokens.weight" in stages[0][0] and "lm_head.weight" in stages[1][0]
        if "v2" in layout:  # virtual stages interleave: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3
            assert {int(n.split(".")[2]) for n in first} == {0, 2}
        else:
            assert {int(n.split(".")[2]) for n in first} == {0, 1}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    from mega_async.bridge.model_cards import TINY_DEEPSEEK, TINY_GLM

    root = tmp_path_factory.mktemp("rs-families")
    return {"deepseek": init_random_weights(TINY_DEEPSEEK, root / "deepseek", seed=3),
            "glm": init_random_weights(TINY_GLM, root / "glm", seed=3)}


FAMILY_LAYOUTS = [(k, layout, 2, pp) for k in ("deepseek", "glm")
                  for layout, pp in (("megatron:t2", 1), ("megatron:d2e2", 1), ("megatron:p2", 2))]


MTP_COPY = re.compile(r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$")


@pytest.fixture(scope="module")
def families_resharded(families, tmp_path_factory):
    return reshard_all({f"{k}-{layout.split(':')[1]}": (families[k], layout, n) for k, layout, n, _ in FAMILY_LAYOUTS},
                       tmp_path_factory.mktemp("families-resharded"))


@pytest.mark.slow  # six Megatron set-ups (one launch)
@pytest.mark.parametrize("kind, layout, nproc, pp", FAMILY_LAYOUTS,
                         ids=[f"{k}-{l.split(':')[1]}" for k, l, _, _ in FAMILY_LAYOUTS])
def test_family_buckets_equal_unsharded_export(families, families_resharded, kind, layout, nproc, pp):
    """DeepSeek-V3 (MLA low-rank projections and their layernorms) and GLM-4.5 (q/k/v bias): the shared experts,
    the router's correction bias and the dense first layer travel under their HF names, bit for bit."""
    model = families[kind]
    src = load_file(str(model / "model.safetensors"))
    stages, error = families_resharded[f"{kind}-{layout.split(':')[1]}"]
    assert error is None, error
    assert sorted(stages) == list(range(pp))
    got = {}
    for stage, (tensors, info) in stages.items():
        assert not set(tensors) & set(got), "a tensor was sent by two stages"
        got.update(tensors)
        for b in info["buckets"]:
            if b["nbytes"] > BUDGET:  # one unit: a layer's experts, or the HF tensors of one Megatron tensor (q/k/v,
                # or the embedding / output head with the MTP layer's copy of it, checkpoint names of one tensor)
                own = [n for n in b["names"] if not MTP_COPY.match(n)]
                one = len({n.rsplit(".", 2)[0] for n in own}) <= 1 and len(own) <= 3
                assert all(".mlp.experts." in n for n in b["names"]) or one, b["names"]
    assert got.keys() == src.keys()
    for k in src:
        assert got[k].dtype == src[k].dtype and got[k].equal(src[k]), k
    if pp == 2:  # the dense first layer is stage 0's, with its dense MLP names; the MoE layers' pieces are where due
        first = stages[0][0]
        assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
                "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.shared_experts.up_proj.weight",
                "model.embed_tokens.weight"} <= set(first)
        assert {int(n.split(".")[2]) for n in first if n.startswith("model.layers.")} == {0, 1}
        assert "model.layers.3.mlp.gate.e_score_correction_bias" in stages[1][0] and "lm_head.weight" in stages[1][0]
        if kind == "deepseek":
            assert {"model.layers.0.self_attn.q_a_layernorm.weight", "model.layers.0.self_attn.kv_b_proj.weight",
                    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"} <= set(first)
