"""The off-policy objectives inside the train engine: packed micro-batches give the loss of the unpacked rows
(sequence-level GSPO ratios and sequence masks see whole sequences), and the objective changes the update."""
import json

import pytest

from mega_async.bridge.model_cards import TINY_MOE, init_random_weights
from tests.dist.jobs import run_jobs

pytestmark = pytest.mark.slow  # three single-rank Megatron engines (one launch)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return init_random_weights(TINY_MOE, tmp_path_factory.mktemp("obj") / "moe", seed=0)


def test_objectives_in_the_engine(moe, tmp_path):
    cases = {"gspo": ("--objective", "gspo", "--prox", "behavior"), "seq": ("--mode", "seq_mask"),
             "token": ("--prox", "behavior")}
    errors = run_jobs(1, {name: ["objective_worker.py", "--model", str(moe), "--out", str(tmp_path / name), *args]
                          for name, args in cases.items()}, tmp_path / "launch")  # one launch, three engines
    assert all(e is None for e in errors.values()), errors
    gspo, seq, token = (json.loads((tmp_path / name / "result.json").read_text()) for name in cases)
    assert gspo["loss"] == pytest.approx(gspo["expected"], rel=1e-4, abs=1e-6)
    assert seq["loss"] == pytest.approx(seq["expected"], rel=1e-4, abs=1e-6)
    assert 0 < seq["masked"] < 1 and seq["engine_masked"] == pytest.approx(seq["masked"], abs=1e-6)
    assert token["loss"] == pytest.approx(token["expected"], rel=1e-4, abs=1e-6)
    assert max(abs(gspo["weights"][k] - token["weights"][k]) for k in token["weights"]) > 1e-4
