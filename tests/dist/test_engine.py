"""train_batch on gloo: one decoupled-PPO step at TP2, PP2, EP2 (DP2) and TP2+EP2 (4 ranks) gives the
single-rank weights; the loss does not depend on the micro-batch count or the DP split; vocab-parallel
logprobs and entropy (and their gradients) equal the full-vocabulary reference."""
import json
import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

KL_ARGS = ("--kl-coef", "0.5", "--kl-estimator", "k3", "--steps", "2")


@pytest.fixture(scope="module")
def models(tiny_weights):
    return tiny_weights


@pytest.fixture(scope="module")
def moe(models):
    return models["moe"]


def dist_jobs(weights: dict, out: Path) -> dict:
    """Every engine run of this module: {name: (nproc, job)} (run by conftest's dist_runs, with other modules')."""
    moe, dense = str(weights["moe"]), str(weights["dense"])

    def eng(name, nproc, model, layout, *extra):
        return name, (nproc, ["engine_worker.py", "--model", model, "--layout", layout, "--out", str(out / name),
                              *extra])

    return dict([
        eng("ref", 1, moe, "megatron:d1"), eng("d1-micro-batches", 1, moe, "megatron:d1", "--max-tokens-per-mb", "24"),
        eng("klref", 1, moe, "megatron:d1", *KL_ARGS), eng("nokl", 1, moe, "megatron:d1", "--steps", "2"),
        ("logprobs-d1", (1, ["logprobs_worker.py", "megatron:d1"])),
        ("packed-d1", (1, ["packed_worker.py", moe, "megatron:d1"])), eng("dense-ref", 1, dense, "megatron:d1"),
        eng("tp2", 2, moe, "megatron:t2"), eng("pp2", 2, moe, "megatron:p2"), eng("ep2-dp2", 2, moe, "megatron:d2e2"),
        eng("kl-pp2", 2, moe, "megatron:p2", *KL_ARGS), ("logprobs-t2", (2, ["logprobs_worker.py", "megatron:t2"])),
        ("packed-t2", (2, ["packed_worker.py", moe, "megatron:t2"])), eng("dense-vpp", 2, dense, "megatron:p2v2"),
        eng("tp2-ep2", 4, moe, "megatron:d2t2e2"),
    ])


@pytest.fixture(scope="module")
def runs(dist_runs):
    """name -> (out dir, error or None) of every engine run of this module."""
    out = dist_runs.out(__name__)
    return {name: (out / name, error) for name, error in dist_runs.of(__name__).items()}


def result(runs, name) -> tuple[dict, dict]:
    out, error = runs[name]
    assert error is None, error
    return load_file(str(out / "stepped.safetensors")), json.loads((out / "stats.json").read_text())


@pytest.fixture(scope="module")
def reference(runs):
    return result(runs, "ref")


def test_single_rank_step_moves_weights_and_reports_stats(moe, reference):
    weights, stats = reference
    src = load_file(str(moe / "model.safetensors"))
    assert max((weights[k] - src[k]).abs().max().item() for k in src) > 1e-4
    assert stats["tokens"] == 102 and 0 < stats["entropy"] < 7.0
    assert stats["staleness"] > 0 and stats["imp_weight_capped_frac"] > 0  # versions 0/1 at version 2; cap 5
    assert stats["behav_w_p01"] < 1.0 < stats["behav_w_p99"]  # stale tokens: weights on both sides of 1
    assert stats["approx_kl"] == pytest.approx(0.0, abs=1e-6)  # recomputed prox = current policy before the step


LAYOUTS = {"d1-micro-batches": dict(tp=1, pp=1, ep=1, dp=1), "tp2": dict(tp=2, pp=1, ep=1, dp=1),
           "pp2": dict(tp=1, pp=2, ep=1, dp=1), "ep2-dp2": dict(tp=1, pp=1, ep=2, dp=2),
           "tp2-ep2": dict(tp=2, pp=1, ep=2, dp=2)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ppo_step_parity(runs, reference, name):
    """Many micro-batches instead of one; TP2; PP2; DP2 x EP2 (each rank trains on its share of whole prompt
    groups); TP2 x EP2 on 4 ranks: the single-rank step's weights and loss."""
    ref_w, ref_s = reference
    w, s = result(runs, name)
    assert {k: s["parallel"][k] for k in LAYOUTS[name]} == LAYOUTS[name]  # the launch's earlier jobs left nothing
    diff = max((w[k] - ref_w[k]).abs().max().item() for k in ref_w)
    assert diff < 1e-5, f"{name}: weights differ by {diff}"
    assert s["loss"] == pytest.approx(ref_s["loss"], abs=1e-6) and s["tokens"] == ref_s["tokens"]
    for q in ("p01", "p50", "p99"):  # the behaviour-weight histogram is summed over micro-batches, DP and across PP
        assert abs(math.log(s[f"behav_w_{q}"] / ref_s[f"behav_w_{q}"])) <= 0.0101, (name, q)  # within one bin


@pytest.fixture(scope="module")
def kl_reference(runs):
    return result(runs, "klref")


def test_kl_to_reference_is_in_the_loss(kl_reference, reference):
    """Two steps with kl_coef > 0: the reference is the initial policy (KL 0 at step 1); at step 2 the reported
    KL equals k3 computed outside the engine from compute_logprobs of the policy and of the reference."""
    _, s = kl_reference
    first, second = s["history"]
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-7)
    assert first["loss"] == pytest.approx(reference[1]["loss"], abs=1e-6)  # k3 adds nothing where policy = ref
    assert second["kl_ref"] > 1e-5
    assert second["kl_ref"] == pytest.approx(s["expected_kl_ref"], rel=1e-4)


def test_kl_penalty_changes_the_update(runs, kl_reference):
    """The same two steps without the penalty end elsewhere: the KL term reaches the gradients."""
    w_kl, s_kl = kl_reference
    w, s = result(runs, "nokl")
    assert s["history"][0]["loss"] == pytest.approx(s_kl["history"][0]["loss"], abs=1e-7)
    assert s["history"][1]["kl_ref"] == 0.0  # not computed without the penalty
    assert max((w[k] - w_kl[k]).abs().max().item() for k in w) > 1e-4


def test_kl_step_parity_pp2(runs, kl_reference):
    """Reference logprobs broadcast across pipeline stages: two KL-penalised steps at PP2 equal one rank's."""
    ref_w, ref_s = kl_reference
    w, s = result(runs, "kl-pp2")
    assert s["parallel"]["pp"] == 2
    assert max((w[k] - ref_w[k]).abs().max().item() for k in ref_w) < 1e-5
    assert s["kl_ref"] == pytest.approx(ref_s["kl_ref"], rel=1e-4) and s["loss"] == pytest.approx(ref_s["loss"], abs=1e-6)


@pytest.mark.parametrize("name", ["logprobs-d1", "logprobs-t2"])
def test_vocab_parallel_logprobs(runs, name):
    assert runs[name][1] is None, runs[name][1]


@pytest.mark.parametrize("name", ["packed-d1", "packed-t2"])
def test_packed_forward_equals_per_sequence(runs, name):
    assert runs[name][1] is None, runs[name][1]


def test_ppo_step_interleaved_vpp_dense(runs):
    """Dense Qwen3 with tied embeddings: PP2 x VPP2 (interleaved 1F1B) equals the single-rank step."""
    ref_w, ref_s = result(runs, "dense-ref")
    w, s = result(runs, "dense-vpp")
    assert s["parallel"]["pp"] == 2 and s["parallel"]["vpp"] == 2
    assert max((w[k] - ref_w[k]).abs().max().item() for k in ref_w) < 1e-5
    assert s["loss"] == pytest.approx(ref_s["loss"], abs=1e-6)
