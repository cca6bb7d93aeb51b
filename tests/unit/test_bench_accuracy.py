"""The nightly benchmark's task scenario: accuracy figures from the per-step reward, the sft:/accuracy: sections,
the cached SFT run, and the gate on accuracy figures."""
import hashlib
import json
from pathlib import Path

import pytest

from mega_async.bench import gate as bench_gate, scenarios as bench

ROOT = Path(__file__).resolve().parents[2]


def hist(rewards, dt=2.0):
    return [{"step": i, "elapsed_s": dt * (i + 1), "reward_mean": r} for i, r in enumerate(rewards)]


def test_accuracy_figures():
    f = bench.accuracy_figures(hist([0.1, 0.4, 0.6, 0.2, 0.9, 0.9]), target=0.6, window=3)
    assert f["accuracy_at_step"] == pytest.approx((0.2 + 0.9 + 0.9) / 3)
    assert f["time_to_accuracy_s"] == 12.0  # (0.2 + 0.9 + 0.9) / 3 first reaches 0.6 at the sixth step
    assert bench.accuracy_figures(hist([0.9]), 0.5, window=3) == {"accuracy_at_step": None, "time_to_accuracy_s": None}
    assert bench.accuracy_figures(hist([0.1, 0.2, 0.1]), 0.5)["time_to_accuracy_s"] is None


def test_addition_scenario_loads_and_bad_sections_are_refused(tmp_path):
    s = bench.load_scenario(ROOT / "configs" / "bench" / "addition.yaml")
    assert s.sft["config"] == "configs/addition_sft_cpu.yaml" and s.accuracy == {"target": 0.5, "window": 3}
    assert {"accuracy_at_step", "time_to_accuracy_s", "sft_accuracy_greedy"} <= set(s.figures)
    for bad in ("sft: {config: a.yaml, steps: 3}\ntrain: {config: b.yaml}",
                "sft: {config: a.yaml}\nexecutor: {}",
                "accuracy: {target: high}\ntrain: {config: b.yaml}",
                "accuracy: {target: 0.5, window: 0}\ntrain: {config: b.yaml}"):
        p = tmp_path / "s.yaml"
        p.write_text(bad)
        with pytest.raises(bench.BenchError, match="sft:|accuracy:"):
            bench.load_scenario(p)


def test_countdown_scenario_starts_from_the_shipped_sft_and_is_in_the_baseline():
    """Item 6 of issue 35: the long-tail task is gated nightly. It trains from the shipped start (an SFT trained on
    the night's machine moves with its CPU), and the checked-in baseline has it, so its figures are judged."""
    from omegaconf import OmegaConf

    s = bench.load_scenario(ROOT / "configs" / "bench" / "countdown.yaml")
    assert s.sft is None and s.accuracy == {"target": 0.5, "window": 3}
    rl = OmegaConf.load(ROOT / s.train["config"])
    assert rl.model.path == "benchmarks/sft/countdown/final_hf" and (ROOT / rl.model.path / "config.json").exists()
    assert {"accuracy_at_step", "time_to_accuracy_s", "gen_len_max_over_median"} <= set(s.figures)
    base = json.loads((ROOT / "benchmarks" / "baselines" / "cpu.json").read_text())["scenarios"]["countdown"]
    assert set(s.figures) <= set(base["figures"])
    assert all(base["figures"][f]["median"] is not None for f in s.figures)


def test_prepare_sft_reuses_a_finished_run(tmp_path):
    cfg = tmp_path / "sft.yaml"
    cfg.write_text("trainer: {total_steps: 3}\n")
    key = hashlib.sha256(cfg.read_text().encode() + repr(["x=1"]).encode()).hexdigest()[:12]
    run = tmp_path / "cache" / "bench_sft" / key
    (run / "final_hf").mkdir(parents=True)
    (run / "final_hf" / "config.json").write_text("{}")
    (run / "sft_eval.json").write_text(json.dumps({"greedy": 0.3, "sampled_t1": 0.2}))
    assert bench.prepare_sft({"config": str(cfg), "overrides": ["x=1"]}, tmp_path / "cache") == run  # no run


def test_gate_on_accuracy_figures():
    rules = {"accuracy_at_step": {"better": "higher", "threshold": 0.2, "max_tolerance": 0.4},
             "time_to_accuracy_s": {"better": "lower", "threshold": 0.5, "max_tolerance": 1.0}}

    def result(acc, ttr):
        return {"scenarios": {"addition": {"rules": rules, "figures": {
            "accuracy_at_step": bench_gate.stat(acc), "time_to_accuracy_s": bench_gate.stat(ttr)}}}}

    base = result([0.6, 0.62, 0.58], [40, 42, 38])
    v = {x["figure"]: x["verdict"] for x in bench_gate.compare(result([0.3, 0.32, 0.31], [41, 40, 39]), base)}
    assert v == {"accuracy_at_step": "REGRESSED", "time_to_accuracy_s": "ok"}
    v = {x["figure"]: x["verdict"] for x in bench_gate.compare(result([0.6, 0.6, 0.61], [None, None, None]), base)}
    assert v["time_to_accuracy_s"] == "REGRESSED"  # the target was no longer reached
