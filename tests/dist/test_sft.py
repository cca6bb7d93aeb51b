"""The SFT loss inside the train engine: equal to transformers' cross-entropy (with and without label
smoothing) on the same batch, and the engine's update equal to a torch Adam step on the same gradient."""
import json
from pathlib import Path

import pytest

from mega_async.bridge.model_cards import init_random_weights
from tests.dist.jobs import run_jobs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # two single-rank Megatron engines (one launch)


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    """Both label smoothings in one launch (jobs.run_jobs): smoothing -> (result, error)."""
    out = tmp_path_factory.mktemp("sft")
    model = init_random_weights(ROOT / "models" / "tiny-addition", out / "card", seed=3)
    jobs = {f"s{s}": ["sft_worker.py", "--model", str(model), "--out", str(out / f"s{s}.json"),
                      "--label-smoothing", str(s)] for s in (0.0, 0.25)}
    errors = run_jobs(1, jobs, out / "launch")
    return {s: (out / f"s{s}.json", errors[f"s{s}"]) for s in (0.0, 0.25)}


@pytest.mark.parametrize("smoothing", [0.0, 0.25])
def test_sft_loss_and_step_in_the_engine(sft_runs, smoothing):
    path, error = sft_runs[smoothing]
    assert error is None, error
    res = json.loads(path.read_text())
    assert res["tokens"] == res["mask_tokens"] > 0  # the answer tokens and EOS, nothing else
    assert res["loss"] == pytest.approx(res["expected"], rel=1e-5)
    assert res["max_weight_diff"] < 1e-4  # the step is lr 1e-3 per weight: the same update
