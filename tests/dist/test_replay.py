"""Routing replay (R3) in the train engine on gloo. Rollout routes come from a transformers forward on the same
tokens: with the same weights the trainer's own routing equals them on every token (so routes line up with
positions and layers); routes from perturbed routers differ, and with replay on the trainer routes every token
to the rollout's experts, which changes its logprobs. At EP2, PP2, PP2 x VPP2 and TP2 the replayed logprobs, the
agreement counts and one replayed PPO step equal the single rank's; with VPP2 each virtual chunk replays its
own layer."""
import json
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mega_async.bridge.model_cards import TINY_MOE, init_random_weights
from mega_async.trainer.parallel import parse_allocation

sys.path.insert(0, str(Path(__file__).parent))
from jobs import run_grouped  # noqa: E402

pytestmark = pytest.mark.slow  # starts servers or trainer ranks: CI's second step keeps the default suite under 20 minutes on 2 cores

ROUTE_KEYS = ("mismatch/route_top1_frac", "mismatch/route_set_frac")


def read(out: Path) -> tuple[dict, dict, dict]:
    return (json.loads((out / "stats.json").read_text()), load_file(str(out / "logprobs.safetensors")),
            load_file(str(out / "stepped.safetensors")))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mega_async.bridge.model_cards import TINY_DEEPSEEK, TINY_GLM

    root = tmp_path_factory.mktemp("r3")
    return {"moe": init_random_weights(TINY_MOE, root / "moe", seed=0),
            "deepseek": init_random_weights(TINY_DEEPSEEK, root / "deepseek", seed=0),
            "glm": init_random_weights(TINY_GLM, root / "glm", seed=0)}


PARITY = {"ep2-dp2": ("moe", "megatron:d2e2"), "pp2": ("moe", "megatron:p2"), "pp2-vpp2": ("moe", "megatron:p2v2"),
          "tp2": ("moe", "megatron:t2"), "deepseek-ep2": ("deepseek", "megatron:d2e2"),
          "deepseek-tp2": ("deepseek", "megatron:t2"), "glm-pp2": ("glm", "megatron:p2")}


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    """Every replay run of this module: the three single-rank references and the seven parallel layouts, in two
    launches (jobs.run_grouped). name -> (stats, logprobs, stepped) or the job's error text."""
    out = tmp_path_factory.mktemp("r3runs")
    cases = {f"{k}-d1": (1, k, "megatron:d1") for k in models}
    cases.update({name: (2, k, layout) for name, (k, layout) in PARITY.items()})
    errors = run_grouped({name: (n, ["replay_worker.py", "--model", str(models[k]), "--layout", layout, "--out",
                                     str(out / name)]) for name, (n, k, layout) in cases.items()}, out)
    return {name: errors[name] or read(out / name) for name in cases}


def result(runs: dict, name: str) -> tuple[dict, dict, dict]:
    res = runs[name]
    assert isinstance(res, tuple), res
    layout = parse_allocation(dict(PARITY).get(name, ("", "megatron:d1"))[1]).train
    assert res[0]["parallel"] == {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "vpp": max(layout.vpp, 1)}
    return res


@pytest.fixture(scope="module")
def moe(models):
    return models["moe"]


@pytest.fixture(scope="module")
def single(runs):
    return result(runs, "moe-d1")


def test_replay_makes_the_trainer_route_like_the_rollout(moe, single):
    stats, lp, _ = single
    layers = [k for k in stats["same_off"] if k.startswith("mismatch/route_set_frac/layer")]
    assert len(layers) == json.loads((moe / "config.json").read_text())["num_hidden_layers"]  # one per MoE layer
    for k in ROUTE_KEYS:  # the same weights route identically: positions and layers line up
        assert stats["same_off"][k] == 0.0 and stats["same_on"][k] == 0.0
    assert stats["foreign_off"]["mismatch/route_set_frac"] > 0.5  # perturbed routers pick other experts
    assert stats["foreign_on"]["mismatch/route_set_frac"] == 0.0  # replayed: the rollout's experts, every token
    assert all(stats["foreign_on"][k] == 0.0 for k in layers)
    assert stats["train"]["mismatch/route_set_frac"] == 0.0  # the training forward replays as well
    m = lp["mask"].bool()
    assert (lp["same"] - lp["free"])[m].abs().max() < 1e-6  # replaying the trainer's own routes changes nothing
    assert (lp["replayed"] - lp["free"])[m].abs().max() > 1e-3  # other experts, other logprobs


@pytest.mark.slow
@pytest.mark.parametrize("layout, nproc", [("megatron:d2e2", 2), ("megatron:p2", 2), ("megatron:p2v2", 2),
                                          ("megatron:t2", 2)], ids=["ep2-dp2", "pp2", "pp2-vpp2", "tp2"])
def test_replay_parity(runs, single, layout, nproc):
    name = next(n for n, (k, lay) in PARITY.items() if k == "moe" and lay == layout)
    (s1, lp1, w1), (s, lp, w) = single, result(runs, name)
    for case in ("same_off", "foreign_off", "foreign_on"):
        assert s[case] == pytest.approx(s1[case], abs=1e-12), case
    m = lp1["mask"].bool()
    for k in ("free", "replayed"):
        assert (lp[k] - lp1[k])[m].abs().max() < 1e-5, k
    assert max((w[k] - w1[k]).abs().max().item() for k in w1) < 1e-5
    assert s["train"]["loss"] == pytest.approx(s1["train"]["loss"], abs=1e-6)


@pytest.fixture(scope="module")
def families(models):
    return {k: models[k] for k in ("deepseek", "glm")}


@pytest.fixture(scope="module")
def families_single(runs):
    return {k: result(runs, f"{k}-d1") for k in ("deepseek", "glm")}


@pytest.mark.parametrize("kind", ["deepseek", "glm"])
def test_replay_of_bias_corrected_group_limited_routes(families, families_single, kind):
    """DeepSeek-V3 (group-limited top-k) and GLM-4.5: rollout routes from transformers' router with its correction
    bias shifted select other experts; replayed, the trainer picks exactly those and weights them as that
    rollout did (the bias ranks, the unbiased sigmoid scores weight): its logprobs equal transformers' forward
    with the shifted bias. The per-layer stats name the MoE layers only (layer 0 is dense)."""
    stats, lp, _ = families_single[kind]
    cfg = json.loads((families[kind] / "config.json").read_text())
    dense = cfg["first_k_dense_replace"]
    layers = sorted(int(k.rsplit("layer", 1)[1]) for k in stats["same_off"] if k.startswith("mismatch/route_set_frac/layer"))
    assert layers == list(range(dense, cfg["num_hidden_layers"]))
    m = lp["mask"].bool()
    assert (lp["same"] - lp["hf"])[m].abs().max() < 1e-5  # the packed engine forward equals transformers'
    for k in ROUTE_KEYS:  # the same weights and bias route identically (the unsorted top-k compared as sets)
        assert stats["same_off"][k] == 0.0 and stats["same_on"][k] == 0.0
    assert stats["rebiased_off"]["mismatch/route_set_frac"] > 0.2  # the bias changes the selection
    assert stats["rebiased_on"]["mismatch/route_set_frac"] == 0.0
    assert stats["foreign_on"]["mismatch/route_set_frac"] == 0.0 and stats["train"]["mismatch/route_set_frac"] == 0.0
    assert (lp["hf_rebiased"] - lp["hf"])[m].abs().max() > 1e-3  # other experts, other logprobs
    gap = (lp["rebiased"] - lp["hf_rebiased"])[m].abs().max().item()
    assert gap < 1e-5, f"{kind}: replayed logprobs differ from the rollout forward's by {gap}"


@pytest.mark.parametrize("kind, layout", [("deepseek", "megatron:d2e2"), ("deepseek", "megatron:t2"),
                                          ("glm", "megatron:p2")], ids=["deepseek-ep2", "deepseek-tp2", "glm-pp2"])
def test_family_replay_parity(runs, families_single, kind, layout):
    name = next(n for n, (k, lay) in PARITY.items() if k == kind and lay == layout)
    (s1, lp1, w1), (s, lp, w) = families_single[kind], result(runs, name)
    for case in ("same_off", "rebiased_off", "rebiased_on", "foreign_on"):
        assert s[case] == pytest.approx(s1[case], abs=1e-12), case
    m = lp1["mask"].bool()
    for k in ("free", "replayed", "rebiased"):
        assert (lp[k] - lp1[k])[m].abs().max() < 1e-5, k
    assert max((w[k] - w1[k]).abs().max().item() for k in w1) < 1e-5
