"""Megatron parity on gloo, 1 to 4 ranks, fp32: logits equal transformers', HF export equals the source
safetensors bit for bit, and one training step on a parallel layout equals the single-rank step."""
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mega_async.trainer.parallel import parse_allocation
from tests.dist.jobs import run_jobs

WORKER = Path(__file__).with_name("parity_worker.py")


def parity_job(weights: dict, kind: str, layout: str, mbs: int, out: Path) -> list[str]:
    return ["parity_worker.py", "--model", str(weights[kind]), "--layout", layout, "--out", str(out),
            "--microbatches", str(mbs)]


def loaded(errors: dict, out: Path) -> dict:
    """{name: error or None} -> {name: {logits, export, stepped: tensors, parallel: the layout it ran at} or the
    job's error text}."""
    return {name: error or {
        **{k: load_file(str(out / name / f"{k}.safetensors")) for k in ("logits", "export", "stepped")},
        "parallel": json.loads((out / name / "parallel.json").read_text())} for name, error in errors.items()}


def run_all(weights: dict, cases: dict, out: Path) -> dict:
    """{name: (kind, layout, nproc, micro-batches)} -> {name: result (see loaded)}, one launch per rank count."""
    errors: dict = {}
    for nproc in sorted({c[2] for c in cases.values()}):
        jobs = {name: parity_job(weights, kind, layout, mbs, out / name)
                for name, (kind, layout, n, mbs) in cases.items() if n == nproc}
        errors.update(run_jobs(nproc, jobs, out / f"launch{nproc}"))
    return loaded(errors, out)


def result(runs: dict, name: str) -> dict:
    res = runs[name]
    assert isinstance(res, dict), res
    return res


@pytest.fixture(scope="module")
def weights(tiny_weights):
    return tiny_weights


DEFAULT = {"moe": ("moe", "megatron:d1", 1, 1), "dense": ("dense", "megatron:d1", 1, 1),
           "etp2": ("moe", "megatron:(attn:d2|ffn:t2)", 2, 1)}  # name: (kind, layout, nproc, micro-batches)


def dist_jobs(weights: dict, out: Path) -> dict:
    """The default runs (run by conftest's dist_runs, with other modules' jobs)."""
    return {name: (n, parity_job(weights, kind, layout, mbs, out / name)) for name, (kind, layout, n, mbs)
            in DEFAULT.items()}


@pytest.fixture(scope="module")
def default_runs(dist_runs):
    return loaded(dist_runs.of(__name__), dist_runs.out(__name__))


@pytest.fixture(scope="module")
def single_rank(default_runs):
    return {k: result(default_runs, k) for k in ("moe", "dense")}


def hf_logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(WORKER.parent))
    from parity_worker import batch

    tokens, _ = batch()
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(tokens).logits


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_single_rank_matches_transformers_and_exports_exactly(weights, single_rank, kind):
    res = single_rank[kind]
    assert (res["logits"]["logits"] - hf_logits(weights[kind])).abs().max() < 1e-4
    src = load_file(str(weights[kind] / "model.safetensors"))
    assert res["export"].keys() == src.keys()
    assert all(torch.equal(res["export"][k], src[k]) for k in src)
    moved = max((res["stepped"][k] - src[k]).abs().max().item() for k in src)
    assert moved > 1e-4  # the training step really changed the weights


LAYOUTS = [
    ("moe", "megatron:t2", 2, 1),  # TP2 (+ sequence parallel, ETP = TP)
    ("moe", "megatron:d2e2", 2, 1),  # EP2 with DP2 for the dense part
    ("moe", "megatron:p2", 2, 1),  # PP2
    ("moe", "megatron:d2t2e2", 4, 1),  # TP2 + EP2 (experts not tensor-split: ETP1)
    ("moe", "megatron:d1", 1, 4),  # the same batch in 4 micro-batches
    ("dense", "megatron:t2", 2, 1),
    ("dense", "megatron:p2", 2, 1),  # tied embeddings across pipeline stages
    ("dense", "megatron:p2v2", 2, 2),  # interleaved virtual pipeline (VPP2)
]


@pytest.fixture(scope="module")
def layout_runs(weights, tmp_path_factory):
    return run_all(weights, {f"{k}-{l}-mb{m}": (k, l, n, m) for k, l, n, m in LAYOUTS}, tmp_path_factory.mktemp("lay"))


# eight Megatron set-ups in three launches: CI's second step (the resharder and engine parity stay in the default)
@pytest.mark.slow
@pytest.mark.parametrize("kind, layout, nproc, mbs", LAYOUTS, ids=[f"{k}-{l}-mb{m}" for k, l, _, m in LAYOUTS])
def test_layout_parity(weights, single_rank, layout_runs, kind, layout, nproc, mbs):
    ref = single_rank[kind]
    res = result(layout_runs, f"{kind}-{layout}-mb{mbs}")
    want = parse_allocation(layout).train
    assert (res["parallel"]["tp"], res["parallel"]["pp"], res["parallel"]["ep"], res["parallel"]["vpp"]) == \
        (want.tp, want.pp, want.ep, max(want.vpp, 1))  # as asked, whatever ran before it in the launch
    assert (res["logits"]["logits"] - ref["logits"]["logits"]).abs().max() < 1e-4
    src = load_file(str(weights[kind] / "model.safetensors"))
    assert res["export"].keys() == src.keys() and all(torch.equal(res["export"][k], src[k]) for k in src)
    assert res["stepped"].keys() == ref["stepped"].keys()
    diff = max((res["stepped"][k] - ref["stepped"][k]).abs().max().item() for k in src)
    assert diff < 1e-5, f"{layout}: updated weights differ from the single-rank step by {diff}"


def test_etp2_hybrid_forward_and_export(weights, single_rank, default_runs):
    """ETP2 with attention TP1 (hybrid form): logits and export match. Its training step is a known gap."""
    ref = single_rank["moe"]
    res = result(default_runs, "etp2")
    assert res["parallel"]["etp"] == 2 and res["parallel"]["tp"] == 1
    assert (res["logits"]["logits"] - ref["logits"]["logits"]).abs().max() < 1e-4
    src = load_file(str(weights["moe"] / "model.safetensors"))
    assert all(torch.equal(res["export"][k], src[k]) for k in src)
