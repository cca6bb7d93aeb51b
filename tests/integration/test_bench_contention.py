"""tools/bench_contention.py end to end on the tiny card with a few short requests: generation measured with the
trainer's half of the CPUs idle and busy, the training loops gone afterwards."""
import importlib.util
import json
from pathlib import Path

import psutil
import pytest

from mega_async.bridge.model_cards import ensure_weights

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_contention", ROOT / "tools" / "bench_contention.py")
bc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bc)
pytestmark = pytest.mark.slow  # starts a server and two training loops


def test_generation_with_the_trainer_half_idle_and_busy(tmp_path):
    card = ROOT / "models" / "tiny-qwen3-moe"
    ensure_weights(card)
    out = tmp_path / "contention.json"
    assert bc.main(["--model", str(card), "--requests", "4", "--new-tokens", "8", "--train-tokens", "64",
                    "--rounds", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["idle_tok_s"]) == len(res["busy_tok_s"]) == 1 and res["idle_median"] > 0 < res["busy_median"]
    assert res["busy_over_idle"] == pytest.approx(res["busy_median"] / res["idle_median"])
    assert set(res["server_cpus"]).isdisjoint(res["trainer_cpus"])
    assert not [p for p in psutil.Process().children(recursive=True) if p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]  # the loops and the server are gone
