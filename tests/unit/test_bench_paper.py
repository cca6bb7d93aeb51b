"""tools/bench_paper.py: the variants, the statistics (Student-t intervals, time to target, same-step accuracy),
the sweep's resume of a half-done sweep, and table + figures from recorded results."""
import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_paper", ROOT / "tools" / "bench_paper.py")
bp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bp)


def test_variants_cover_the_paper_sweep():
    names = [v["name"] for v in bp.all_variants()]
    assert names[0] == "sync" and len(names) == len(set(names)) == 1 + 2 * 5 + 1 + 6 + 3 + 6  # + issue 35's controls
    for e in (1, 2, 4, 8, 16):
        assert {f"eta{e}-dec", f"eta{e}-ppo", f"eta{e}-dec-unpinned"} <= set(names)
    v = {x["name"]: x for x in bp.all_variants()}
    assert v["eta4-dec-nointr"]["interrupt"] == "none" and v["eta8-ppo"]["objective"] == "ppo"
    assert not v["sync-unpinned"]["pin"] and v["sync"]["pin"]
    assert [x["name"] for x in bp.pick(bp.all_variants(), "sync,eta1-*")] == [
        "sync", "eta1-dec", "eta1-ppo", "eta1-dec-unpinned", "eta1-dec-lr4", "eta1-dec-mb1"]
    with pytest.raises(SystemExit, match="eta3"):
        bp.pick(bp.all_variants(), "eta3-dec")
    ov = bp.overrides(v["eta8-ppo"], 3, 100, Path("/r"), Path("/s"))
    assert "algorithm.prox_logp=behavior" in ov and "rollout.max_staleness=8" in ov and "seed=3" in ov
    assert "model.path=/s/final_hf" in ov and "data.path=/s/rl_prompts.jsonl" in ov
    assert "algorithm.prox_logp=recompute" in bp.overrides(v["eta8-dec"], 3, 100, Path("/r"), Path("/s"))


def test_t_interval_by_hand():
    s = bp.t_interval([1.0, 2.0, 3.0, 4.0, 5.0, None])
    assert s["n"] == 5 and s["mean"] == 3.0
    assert s["ci95"] == pytest.approx(2.776 * statistics.stdev([1, 2, 3, 4, 5]) / math.sqrt(5), rel=1e-9)
    assert bp.t_interval([0.4])["ci95"] is None and bp.t_interval([None])["mean"] is None
    assert bp.t_interval([2.0, 4.0])["ci95"] == pytest.approx(12.706 * math.sqrt(2) / math.sqrt(2))


def test_t_quantiles_match_scipy():
    import scipy.stats as st  # a test dependency (setup.py): never skipped
    for df, q in enumerate(bp.T975, start=1):
        assert q == pytest.approx(st.t.ppf(0.975, df), abs=6e-4)


def curve(rewards, dt=10.0, tokens=100):
    return [[i, dt * (i + 1), r, tokens * (i + 1)] for i, r in enumerate(rewards)]


def test_time_to_target_and_reward_at():
    c = curve([0.2, 0.9, 0.3, 0.7, 0.8, 0.9])
    assert bp.time_to_target(c, 0.8, window=1) == 20.0  # one step above
    assert bp.time_to_target(c, 0.75, window=3) == 60.0  # (0.7 + 0.8 + 0.9) / 3; (0.3 + 0.7 + 0.8) / 3 < 0.75
    assert bp.time_to_target(c, 0.95) is None
    assert bp.reward_at(c, 5, window=2) == pytest.approx(0.85) and bp.reward_at(c, 9) is None


def test_window_reward_pools_the_samples_of_the_window():
    # cumulative (sum, count): step 0 scored 10 samples (2 right), step 1 only 2 (both right), step 2 10 (8 right)
    c = [[0, 1.0, 0.2, 0, 2, 10], [1, 2.0, 1.0, 0, 4, 12], [2, 3.0, 0.8, 0, 12, 22]]
    assert bp.window_reward(c, 2, 2) == pytest.approx(10 / 12)  # not the mean of 1.0 and 0.8
    assert bp.window_reward(c, 2, 5) == pytest.approx(12 / 22)
    assert bp.time_to_target(c, 0.8, window=2) == 3.0 and bp.time_to_target(c, 0.5, window=1) == 2.0
    assert bp.reward_at(c, 1, window=1) == 1.0


def fake(name, seed, eta=4, objective="dec", interrupt="abort", pin=True, rewards=(0.3, 0.5, 0.7), wall=30.0,
         greedy=0.8, gen=500.0):
    c = curve(rewards, dt=wall / len(rewards))
    return {"name": name, "eta": eta, "objective": objective, "interrupt": interrupt, "pin": pin, "seed": seed,
            "steps": len(rewards), "wall_s": wall, "reward_final": statistics.fmean(rewards),
            "time_to_target_s": bp.time_to_target(c, 0.5, window=1), "gen_tokens_per_s": gen,
            "gen_groups_per_s": gen / 50, "trained_tokens_per_s": c[-1][3] / wall, "staleness_mean": eta / 4,
            "curve": c, "final_eval": {"greedy": greedy, "sampled_t1": greedy - 0.1}}


def test_sweep_resumes_a_half_done_sweep(tmp_path):
    variants = bp.pick(bp.all_variants(), "sync,eta4-dec")
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "sync_s1.json").write_text(json.dumps(fake("sync", 1, eta=0)))  # done before the cut
    calls = []

    def runner(v, seed):
        calls.append((v["name"], seed))
        if (v["name"], seed) == ("eta4-dec", 2):
            raise RuntimeError("run eta4-dec_s2 failed (exit 1): boom")
        return fake(v["name"], seed, eta=v["eta"])

    results, failed, skipped = bp.sweep(variants, [1, 2], tmp_path, runner)
    assert calls == [("eta4-dec", 1), ("sync", 2), ("eta4-dec", 2)]
    assert len(results) == 3 and failed == ["eta4-dec_s2: run eta4-dec_s2 failed (exit 1): boom"]
    assert not (tmp_path / "raw" / "eta4-dec_s2.json").exists()
    calls.clear()

    def again(v, seed):  # the machine recovered: the rerun makes only what is missing
        calls.append((v["name"], seed))
        return fake(v["name"], seed, eta=v["eta"])

    results, failed, skipped = bp.sweep(variants, [1, 2], tmp_path, again)
    assert calls == [("eta4-dec", 2)] and not failed and not skipped and len(results) == 4
    assert sorted(p.name for p in (tmp_path / "raw").iterdir()) == [
        "eta4-dec_s1.json", "eta4-dec_s2.json", "sync_s1.json", "sync_s2.json"]


def test_a_deadline_stops_the_sweep_between_runs(tmp_path):
    """--until: no run starts that would end after the deadline (judged by the longest run so far, or the recorded
    ones' process_s before the first); what was not started is named, and the next sitting makes it."""
    variants = bp.pick(bp.all_variants(), "sync,eta4-dec")
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "sync_s1.json").write_text(json.dumps({**fake("sync", 1, eta=0), "process_s": 40.0}))
    now, calls = [1000.0], []

    def runner(v, seed):
        calls.append((v["name"], seed))
        now[0] += 50.0  # each run takes 50 s
        return fake(v["name"], seed, eta=v["eta"])

    results, failed, skipped = bp.sweep(variants, [1, 2], tmp_path, runner, deadline=1095.0, clock=lambda: now[0])
    # eta4-dec_s1 starts (1000 + 40 recorded <= 1095); seed 2 does not (1050 + sync's 40 + eta4-dec's 50 > 1095)
    assert calls == [("eta4-dec", 1)] and not failed and skipped == ["sync_s2", "eta4-dec_s2"]
    assert len(results) == 2 and not (tmp_path / "raw" / "sync_s2.json").exists()
    results, failed, skipped = bp.sweep(variants, [1, 2], tmp_path, runner, deadline=None, clock=lambda: now[0])
    assert calls[1:] == [("sync", 2), ("eta4-dec", 2)] and not skipped and len(results) == 4


def test_a_deadline_starts_a_seed_only_if_all_its_runs_fit(tmp_path):
    """A seed's runs share a sitting (so a machine, for the pairing with its sync run): a seed starts only if its
    missing runs fit before the deadline together, each expected to take what its variant took at most."""
    variants = bp.pick(bp.all_variants(), "sync,eta4-dec")
    (tmp_path / "raw").mkdir()
    for name, took in (("sync", 60.0), ("eta4-dec", 30.0)):
        (tmp_path / "raw" / f"{name}_s1.json").write_text(json.dumps({**fake(name, 1), "total_s": took}))
    now, calls = [1000.0], []

    def runner(v, seed):
        calls.append((v["name"], seed))
        now[0] += {"sync": 60.0, "eta4-dec": 30.0}[v["name"]]
        return fake(v["name"], seed, eta=v["eta"])

    # seed 2 needs 90 s: it starts at 1000 with a deadline of 1090, and not at 1000 with 1080, though its first run
    # alone (60 s) would fit: the seed waits for a sitting that can hold it whole
    _, _, skipped = bp.sweep(variants, [1, 2], tmp_path, runner, deadline=1080.0, clock=lambda: now[0])
    assert not calls and skipped == ["sync_s2", "eta4-dec_s2"]
    _, _, skipped = bp.sweep(variants, [1, 2, 3], tmp_path, runner, deadline=1090.0, clock=lambda: now[0])
    assert calls == [("sync", 2), ("eta4-dec", 2)] and skipped == ["sync_s3", "eta4-dec_s3"]


def test_a_deadline_judges_a_first_run_by_every_recorded_one(tmp_path):
    """A call with nothing of its own recorded yet (a new sitting's first run, the interrupt=none follow-up) is
    judged by the longest run recorded under `out`, its scoring included (total_s)."""
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "sync_s1.json").write_text(json.dumps({**fake("sync", 1, eta=0), "process_s": 40.0,
                                                               "total_s": 90.0}))
    calls = []
    variants = bp.pick(bp.all_variants(), "eta4-dec-nointr")
    _, _, skipped = bp.sweep(variants, [1], tmp_path, lambda v, sd: calls.append(v) or fake(v["name"], sd),
                             deadline=1080.0, clock=lambda: 1000.0)
    assert not calls and skipped == ["eta4-dec-nointr_s1"]  # 1000 + 90 > 1080 (process_s alone would fit)


def test_until_reads_a_clock_time_or_a_duration():
    import datetime

    now = datetime.datetime(2026, 12, 5, 20, 0).timestamp()
    assert bp.until("21:15", now) - now == 75 * 60
    assert bp.until("19:30", now) - now == (23 * 60 + 30) * 60  # already past today: tomorrow's
    assert bp.until("90m", now) - now == 5400 and bp.until("2h30m", now) - now == 9000
    assert bp.until("5400s", now) - now == 5400 and bp.until("1h", now) - now == 3600
    for bad in ("", "soon", "25:00", "12:5", "-5m", "m"):
        with pytest.raises(SystemExit, match="neither a clock time"):
            bp.until(bad, now)


def recorded():
    runs = []
    for seed, jitter in ((1, 0.0), (2, 0.05), (3, -0.05)):
        runs.append(fake("sync", seed, eta=0, wall=60 + 10 * jitter, rewards=(0.3, 0.6, 0.8), gen=300))
        for e in (1, 4):
            runs.append(fake(f"eta{e}-dec", seed, eta=e, wall=30 + jitter, rewards=(0.3, 0.5 + jitter, 0.8)))
            runs.append(fake(f"eta{e}-ppo", seed, eta=e, objective="ppo", rewards=(0.3, 0.4, 0.4 + jitter),
                             greedy=0.5))
            runs.append(fake(f"eta{e}-dec-unpinned", seed, eta=e, pin=False, wall=45))
        runs.append(fake("eta4-dec-nointr", seed, interrupt="none", gen=350.0 + seed))
        runs.append(fake("sync-unpinned", seed, eta=0, pin=False, wall=70))
    return runs


def test_aggregate_intervals_and_same_step():
    runs = recorded()
    runs.append(fake("eta1-dec", 4, eta=1, rewards=(0.3, 0.5)))  # a shorter run: same-step = its last step
    rows = {r["name"]: r for r in bp.aggregate(runs)}
    d = rows["eta1-dec"]
    assert d["seeds"] == [1, 2, 3, 4] and d["same_step"] == 1 and d["reached"] == 4
    assert d["acc_same_step"]["n"] == 4
    assert rows["eta4-ppo"]["eval_greedy"]["mean"] == pytest.approx(0.5)
    w = rows["sync"]["wall_s"]
    assert w["mean"] == pytest.approx(60.0) and w["ci95"] == pytest.approx(4.303 * 0.5 / math.sqrt(3), rel=1e-6)


def test_table_and_figures_from_recorded_results(tmp_path):
    src = tmp_path / "rec"
    (src / "raw").mkdir(parents=True)
    for i, r in enumerate(recorded()):
        if i % 2:
            r["cpu"] = "AMD EPYC (family 23 model 49, avx2)"  # the machine each run had; older results lack it
        (src / "raw" / f"{r['name']}_s{r['seed']}.json").write_text(json.dumps(r))
    (src / "meta.json").write_text(json.dumps({"target": 0.5, "sft_eval": {"greedy": 0.3, "sampled_t1": 0.2,
                                                                              "problems": 256}}))
    out = tmp_path / "out"
    assert bp.main(["--from-results", str(src), "--out", str(out)]) == 0
    text = (out / "table2.md").read_text()
    assert "SFT start: held-out exact match greedy 0.300" in text
    n = len(recorded())
    cpus = next(line for line in text.splitlines() if line.startswith("Runs by CPU: "))
    assert f"AMD EPYC (family 23 model 49, avx2): {n // 2}" in cpus and f"not recorded: {n - n // 2}" in cpus
    assert "| eta4-ppo | 4 | naive PPO | abort | yes | 3 | 0.500 ± 0.000 |" in text
    assert "| sync | 0 | (same at eta 0) | abort | yes | 3 |" in text and "(3/3)" in text
    names = [line.split(" | ")[0][2:] for line in text.splitlines() if line.startswith("| ") and " | abort " in line
             or " | none " in line]
    assert names[:3] == ["sync", "eta1-dec", "eta1-ppo"] and names.index("eta4-dec") < names.index("sync-unpinned")
    for f in ("fig5a", "fig5b", "fig5c", "fig6b"):
        assert (out / f"{f}.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((out / "runs.json").read_text())
    assert len(saved["runs"]) == len(recorded())
    assert bp.main(["--from-results", str(out / "runs.json"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "table2.md").read_text() == text
    before = {p: p.read_bytes() for p in (bp.ROOT / "benchmarks" / "paper").iterdir() if p.is_file()}
    (out / "table2.md").unlink()
    assert bp.main(["--from-results", str(out / "runs.json")]) == 0  # no --out: in place, not over benchmarks/paper
    assert (out / "table2.md").read_text() == text
    assert bp.main(["--from-results", str(src)]) == 0 and (src / "table2.md").read_text() == text  # a raw/ folder
    assert {p: p.read_bytes() for p in (bp.ROOT / "benchmarks" / "paper").iterdir() if p.is_file()} == before


def test_diagnostics_backfilled_from_the_runs_metrics(tmp_path):
    """Raw results without the objective's diagnostics get them from their run's metrics.jsonl; the table shows
    each diagnostic's mean over the seeds that have it."""
    out, runs_dir = tmp_path / "out", tmp_path / "runs"
    (out / "raw").mkdir(parents=True)
    for seed, stale in ((1, 0.5), (2, 1.5)):
        r = {"name": "eta4-dec", "eta": 4, "objective": "dec", "interrupt": "abort", "pin": True, "seed": seed,
             "wall_s": 10.0, "reward_final": 0.5, "time_to_target_s": None, "curve": [[0, 1.0, 0.5, 10.0]]}
        (out / "raw" / f"eta4-dec_s{seed}.json").write_text(json.dumps(r))
        d = runs_dir / "bench_paper" / f"eta4-dec_s{seed}"
        d.mkdir(parents=True)
        rows = [{"step": i, "train/staleness": stale + i, "train/behav_imp_weight_mean": 1.0, "train/clip_frac": 0.1}
                for i in range(3)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    assert bp.backfill_diagnostics(out, runs_dir) == 2
    assert bp.backfill_diagnostics(out, runs_dir) == 0  # done once
    runs = [json.loads(p.read_text()) for p in sorted((out / "raw").glob("*.json"))]
    assert [r["diag"]["train/staleness"] for r in runs] == [1.5, 2.5]
    table = bp.diagnostics_table(runs)
    # mean 2.0, half-width t(0.975, 1) * stdev / sqrt 2 = 12.706 * 0.7071 / 1.414 = 6.353
    # columns: staleness, weight mean, p1, p50, p99, capped, clipped, KL, ... (the filter and batch ones absent)
    assert "| eta4-dec | 2 | 2 ± 6.353 | 1 ± 0 | - | - | - | - | 0.1 ± 0 | - |" in table


def test_interruptions_counted_from_the_runs_events_and_backfilled(tmp_path):
    """Per run: requests interrupted per step and the tokens they carried back to a server per generated token
    (events.jsonl's episode_interrupted, metrics.jsonl's executor/output_tokens); added to recorded results."""
    out, runs_dir = tmp_path / "out", tmp_path / "runs"
    (out / "raw").mkdir(parents=True)
    d = runs_dir / "bench_paper" / "eta4-dec_s1"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "executor/output_tokens": 100 * (i + 1)}) + "\n"
                                             for i in range(4)))
    cut = [{"kind": "episode_interrupted", "tokens": t} for t in (30, 50, 0)] + [{"kind": "sync_start"}]
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in cut))
    assert bp.interruptions(d) == {"interrupt/per_step": 0.75, "interrupt/resent_frac": 0.2}
    assert bp.interruptions(tmp_path / "nothing") == {}
    r = {"name": "eta4-dec", "eta": 4, "objective": "dec", "interrupt": "abort", "pin": True, "seed": 1,
         "wall_s": 10.0, "reward_final": 0.5, "curve": [[0, 1.0, 0.5, 10.0]], "diag": {"train/staleness": 2.0}}
    (out / "raw" / "eta4-dec_s1.json").write_text(json.dumps(r))
    assert bp.backfill_diagnostics(out, runs_dir) == 1 and bp.backfill_diagnostics(out, runs_dir) == 0
    diag = json.loads((out / "raw" / "eta4-dec_s1.json").read_text())["diag"]
    assert diag == {"train/staleness": 2.0, "interrupt/per_step": 0.75, "interrupt/resent_frac": 0.2}
    assert "requests interrupted per step" in bp.diagnostics_table([{**r, "diag": diag}])


def test_controls_and_the_longtail_sweep_make_their_overrides():
    v = {x["name"]: x for x in bp.all_variants()}
    ov = bp.overrides(v["stale2"], 1, 50, Path("/r"), Path("/s"))
    assert "rollout.max_staleness=0" in ov and "rollout.stale_batches=2" in ov
    ov = bp.overrides(v["eta1-dec-lr4"], 1, 50, Path("/r"), Path("/s"), lr=2e-4)
    assert "trainer.lr=5e-05" in ov and "rollout.max_staleness=1" in ov and not any("stale_batches" in o for o in ov)
    with pytest.raises(ValueError, match="lr"):
        bp.overrides(v["sync-lr4"], 1, 50, Path("/r"), Path("/s"))
    assert "trainer.ppo_n_minibatches=1" in bp.overrides(v["stale1-mb1"], 1, 50, Path("/r"), Path("/s"))
    assert not any("minibatches" in o or "lr=" in o for o in bp.overrides(v["sync"], 1, 50, Path("/r"), Path("/s")))
    lt = [x["name"] for x in bp.pick(bp.longtail_variants(), bp.SWEEPS["longtail"]["variants"])]
    assert lt == ["sync", "eta1-dec", "eta2-dec", "eta4-dec", "eta8-dec", "eta4-ppo", "eta8-ppo"]


def test_dry_run_prints_every_run_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "lt"
    assert bp.main(["--sweep", "longtail", "--dry-run", "--seeds", "1,2", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    cmds = [x for x in lines if not x.startswith("#")]
    assert len(cmds) == 7 * 2 and all("configs/countdown_rl_cpu.yaml" in c and " train " in c for c in cmds)
    assert "trial_name=eta8-ppo_s2" in cmds[-1] and "algorithm.prox_logp=behavior" in cmds[-1]
    assert "nointr" in lines[-1] and not out.exists()  # nothing written, no SFT started
    assert bp.main(["--variants", "stale1-lr4", "--dry-run", "--seeds", "3"]) == 0
    cmd = capsys.readouterr().out.splitlines()[-1]
    assert "rollout.stale_batches=1" in cmd and "trainer.lr=5e-05" in cmd  # a quarter of configs/addition_rl_cpu's


def test_the_real_engine_headline_runs_sync_against_the_best_eta(tmp_path, capsys, monkeypatch):
    """--sweep longtail-sglang (item 4): sync and the long-tail sweep's best decoupled eta, 3 seeds, every run on
    the real engine (inference.backend=sglang, overridable); without async results it names what to run first."""
    best = tmp_path / "longtail"
    with pytest.raises(SystemExit, match="run --sweep longtail first"):
        bp.real_engine_variants(best)
    (best / "raw").mkdir(parents=True)
    for seed in (1, 2):
        for name, eta, rewards in (("sync", 0, (0.2, 0.4, 0.6, 0.6, 0.6, 0.6, 0.6)),
                                   ("eta2-dec", 2, (0.2, 0.3, 0.4, 0.6, 0.6, 0.6, 0.6)),
                                   ("eta4-dec", 4, (0.2, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6))):
            r = fake(name, seed, eta=eta, rewards=rewards, wall=7.0)
            r["reward_final"] = 0.6
            (best / "raw" / f"{name}_s{seed}.json").write_text(json.dumps(r))
    assert bp.real_engine_variants(best) == "sync,eta4-dec"  # eta 4 reaches 0.6 first
    (best / "meta.json").write_text(json.dumps({"best_eta": 2}))  # what the long-tail sweep decided and kept wins
    assert bp.real_engine_variants(best) == "sync,eta2-dec"
    (best / "meta.json").unlink()
    monkeypatch.setitem(bp.SWEEPS["longtail-sglang"], "best_from", str(best))
    assert bp.main(["--sweep", "longtail-sglang", "--dry-run", "--out", str(tmp_path / "o")]) == 0
    cmds = [x for x in capsys.readouterr().out.splitlines() if not x.startswith("#")]
    assert [c.split("trial_name=")[1].split()[0] for c in cmds] == ["sync_s1", "eta4-dec_s1", "sync_s2",
                                                                     "eta4-dec_s2", "sync_s3", "eta4-dec_s3"]
    assert all(c.endswith("inference.backend=sglang") and "bench_longtail_sglang_runs" in c for c in cmds)
    assert bp.main(["--sweep", "longtail-sglang", "--dry-run", "--variants", "sync", "--seeds", "1",
                    "inference.backend=embedded"]) == 0
    cmd = capsys.readouterr().out.splitlines()[-1]
    assert cmd.endswith("inference.backend=sglang inference.backend=embedded")  # the last one wins


def test_held_out_time_to_sync_final_and_at_equal_wall_by_hand(tmp_path):
    """The headline's held-out figures: sync's final held-out greedy (mean over seeds) is the target, which sync
    has at its end (the time to beat); another run reaches it at the first export whose accuracy, averaged with the
    one before (HELDOUT_WINDOW 2), is at least that; held-out at equal wall time is the last export made by the
    shortest run's end."""
    hc = [[9, 10.0, 0.50], [19, 20.0, 0.70], [29, 30.0, 0.60], [39, 40.0, 0.80]]
    assert bp.time_to_heldout(hc, 0.65) == 30.0  # (0.7 + 0.6) / 2; not at 20 s: (0.5 + 0.7) / 2 = 0.6
    assert bp.time_to_heldout(hc, 0.75) is None and bp.time_to_heldout(hc[:1], 0.1) is None
    assert bp.heldout_at_time(hc, 35.0) == 0.60 and bp.heldout_at_time(hc, 5.0) is None
    runs = []
    for seed, fin in ((1, 0.62), (2, 0.68)):  # sync: final held-out 0.65 on average, 40 s per run
        r = fake("sync", seed, eta=0, wall=40.0, greedy=fin)
        r["heldout_curve"] = [[9, 10.0, 0.5], [19, 20.0, 0.6], [29, 30.0, 0.66], [39, 40.0, fin]]
        runs.append(r)
        r = fake("eta2-dec", seed, eta=2, wall=20.0, greedy=0.66)  # reaches 0.65 at its 3rd export (15 s)
        r["heldout_curve"] = [[9, 5.0, 0.6], [19, 10.0, 0.62], [29, 15.0, 0.68], [39, 20.0, 0.66]]
        runs.append(r)
    h = bp.headline(runs)
    assert h["sync_final_heldout"] == pytest.approx(0.65)
    s, e = h["variants"]["sync"], h["variants"]["eta2-dec"]
    # sync has its final accuracy at its end (40 s), though seed 1's last two exports average (0.66 + 0.62) / 2 < 0.65
    assert s["time_to_sync_heldout_s"]["values"] == [40.0, 40.0] and s["reached_heldout"] == 2
    assert bp.time_to_heldout(runs[0]["heldout_curve"], 0.65) is None
    assert e["time_to_sync_heldout_s"]["values"] == [15.0, 15.0] and e["heldout_speedup"] == pytest.approx(40 / 15)
    assert h["equal_wall_s"] == 20.0 and s["heldout_equal_wall"]["values"] == [0.6, 0.6]
    assert e["heldout_equal_wall"]["values"] == [0.66, 0.66] and e["heldout_final"]["mean"] == pytest.approx(0.66)
    assert bp.best_eta(runs) == 2
    table = bp.headline_table(h, ["sync", "eta2-dec"])
    assert "sync's final held-out accuracy 0.650" in table
    # paired by seed, the variant's minus its sync's: plateau 0.64 - 0.595 and 0.64 - 0.61; the 3rd to 5th exports
    # (here the 3rd and 4th): (0.68 + 0.66) / 2 - (0.66 + fin) / 2
    assert e["heldout_plateau_paired"]["values"] == pytest.approx([0.045, 0.03])
    assert e["heldout_early_paired"]["values"] == pytest.approx([0.03, 0.0])
    assert s["heldout_plateau_paired"]["n"] == 0  # sync against itself: no column
    assert ("| eta2-dec | 15 ± 0 (2/2) | 2.67x | 2.67x ± 0.00x | 0.660 ± 0.000 | 0.640 ± 0.000 | +0.038 ± 0.095 | "
            "+0.015 ± 0.191 | 0.660 ± 0.000 |") in table
    assert "| sync | 40 ± 0 (2/2) | 1.00x | - | 0.600 ± 0.000 | 0.603 ± 0.095 | - | - | 0.650 ± 0.381 |" in table
    assert "| sync | 40 ± 0 (2/2) | 1.00x | - |" in table
    # the plateau: the mean of the last PLATEAU_EXPORTS (5) exports, here all 4: (0.5 + 0.6 + 0.66 + fin) / 4
    assert s["heldout_plateau"]["values"] == pytest.approx([0.595, 0.61])
    # the crossing rule applied to sync itself: seed 1 never averages 0.65 over two exports, seed 2 does at its end
    assert s["reached_crossing"] == 1 and s["crossing_s"]["values"] == [40.0] and "crossing_s" not in e
    assert "applied to sync itself reaches 0.650 in 1 of 2 seeds (at 40 s on average)" in table
    assert "against a plateau of 0.603 ± " in table
    never = [dict(r, heldout_curve=[[9, 5.0, 0.1], [19, 10.0, 0.1]]) if r["name"] == "eta2-dec" else r for r in runs]
    assert "| eta2-dec | - (0/2) | - | - |" in bp.headline_table(bp.headline(never), ["sync", "eta2-dec"])  # no "-x"
    # paired by seed: seed 2's runs on a machine half as fast (sync 80 s, the variant at 30 s): each seed's ratio
    slow = [dict(r, wall_s=2 * r["wall_s"], heldout_curve=[[st, 2 * t, a] for st, t, a in r["heldout_curve"]])
            if r["seed"] == 2 else r for r in runs]
    e = bp.headline(slow)["variants"]["eta2-dec"]
    assert e["heldout_speedup_paired"]["values"] == pytest.approx([40 / 15, 80 / 30])
    assert e["heldout_speedup"] == pytest.approx(60 / 22.5)
    lone = [r for r in slow if not (r["name"] == "sync" and r["seed"] == 2)]  # a seed without its sync: not paired
    assert bp.headline(lone)["variants"]["eta2-dec"]["heldout_speedup_paired"]["values"] == pytest.approx([40 / 15])
    moved = [dict(r, cpu="cpu B" if r["name"] == "sync" and r["seed"] == 2 else "cpu A") for r in slow]
    assert bp.headline(moved)["variants"]["eta2-dec"]["heldout_speedup_paired"]["values"] == pytest.approx([40 / 15])
    assert bp.plot_headline(runs, ["sync", "eta2-dec"], tmp_path / "headline.png").stat().st_size > 0
    assert bp.plot_headline([fake("sync", 1, eta=0)], ["sync"], tmp_path / "none.png") is None  # no exports
    # results recorded without exports beside ones with them (--snapshots 0, or older): reward figures only
    mixed = runs + [fake("sync", 3, eta=0, wall=40.0), fake("eta4-dec", 1, eta=4, wall=20.0)]
    h = bp.headline(mixed)
    assert h["variants"]["sync"]["heldout_runs"] == 2 and "time_to_sync_heldout_s" not in h["variants"]["eta4-dec"]
    assert "| eta4-dec |" not in bp.headline_table(h, ["sync", "eta2-dec", "eta4-dec"], 10).split("Held-out")[1]
    assert "exported every 10 steps" in bp.headline_table(h, ["sync"], 10)
    assert bp.plot_headline(mixed, ["sync", "eta2-dec", "eta4-dec"], tmp_path / "mixed.png") is not None
    assert bp.best_eta(mixed) in (2, 4)  # one ranking (by the reward, since eta 4 has no exports): no crash


def with_phases(r, wait, train, busy):
    r["phases"] = {"rollout_wait_s": wait, "train_s": train, "step_s": wait + train, "gen_busy": busy}
    return r


def test_headline_time_to_sync_final_equal_wall_and_bound_by_hand():
    runs = []
    for seed in (1, 2):  # sync: final reward (mean of the last TAIL=5 steps) 0.6, 2 s per step
        runs.append(with_phases(fake("sync", seed, eta=0, rewards=(0.2, 0.4, 0.6, 0.6, 0.6, 0.6, 0.6), wall=14.0),
                                1.5, 0.5, 0.4))
        runs[-1]["reward_final"] = 0.6  # what run_figures records: the last TAIL steps
        runs.append(fake("eta2-dec", seed, eta=2, rewards=(0.2, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6), wall=7.0))
        runs.append(fake("eta8-dec", seed, eta=8, rewards=(0.2, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3), wall=7.0))
    h = bp.headline(runs)
    assert h["sync_final_reward"] == pytest.approx(0.6) and h["equal_wall_s"] == 7.0
    assert h["bound"] == pytest.approx(2.0 / 1.5) and h["bound_tail"] == pytest.approx(2.0 / 0.6)  # 1.5*0.4 = 0.6
    d = h["variants"]["eta2-dec"]
    assert d["reached"] == 2 and d["time_to_sync_final_s"]["mean"] == pytest.approx(6.0)  # window 5 ends at step 5
    assert d["speedup"] == pytest.approx(2.0) and d["fraction_of_tail_bound"] == pytest.approx(2.0 / (2.0 / 0.6))
    assert h["variants"]["eta8-dec"]["reached"] == 0
    assert h["variants"]["sync"]["acc_equal_wall"]["mean"] == pytest.approx((0.2 + 0.4 + 0.6) / 3)  # steps 0-2 by 7 s
    assert bp.best_eta(runs) == 2
    text = bp.headline_table(h, ["sync", "eta2-dec", "eta8-dec"])
    assert "| eta2-dec | 6 ± 0 (2/2) |" in text and "| eta8-dec | - (0/2) |" in text
    assert bp.headline([r for r in runs if r["name"] != "sync"]) == {}


def test_per_step_table_pairs_the_gap_to_sync_by_seed():
    # two seeds whose levels differ a lot: the paired gap is exact, the unpaired spread would swamp it
    runs = [fake("sync", 1, eta=0, rewards=[0.2] * 12), fake("sync", 2, eta=0, rewards=[0.8] * 12),
            fake("eta1-dec", 1, eta=1, rewards=[0.15] * 12), fake("eta1-dec", 2, eta=1, rewards=[0.75] * 12),
            fake("stale1", 1, eta=0, rewards=[0.2] * 5)]  # shorter: steps it did not reach stay empty
    text = bp.per_step_table(runs, steps=(4, 10), window=2)
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines()[2:]}
    assert rows["sync"][2] == "0.500 ± 3.812" and rows["sync"][4] == "-"
    assert rows["eta1-dec"][4] == "-0.050 ± 0.000 (2)" and rows["eta1-dec"][5].startswith("-0.050 ± 0.000 (2)")
    assert rows["stale1"][2] == "0.200 (1 seed)" and rows["stale1"][3] == "-" and rows["stale1"][4] == "+0.000 (1)"
    assert rows["stale1"][5].startswith("-")


def test_a_later_sitting_must_start_from_the_same_sft_model(tmp_path):
    """Sittings span machines whose runs/ was wiped: the SFT run is trained again and must be the same start."""
    sft = tmp_path / "sft"
    (sft / "final_hf").mkdir(parents=True)
    (sft / "final_hf" / "model.safetensors").write_bytes(b"weights-a")
    fp = bp.sft_fingerprint(sft)
    ev = {"greedy": 0.6, "sampled_t1": 0.35, "problems": 128, "samples": 2, "steps": 1500, "train_s": 500.0}
    bp.check_same_start({}, sft, ev, fp, tmp_path)  # nothing recorded: any start
    bp.check_same_start({"sft_sha256": fp, "sft_eval": ev}, sft, {**ev, "train_s": 9.0}, fp, tmp_path)
    (sft / "final_hf" / "model.safetensors").write_bytes(b"weights-b")
    other = bp.sft_fingerprint(sft)
    assert other != fp
    with pytest.raises(SystemExit, match="not the one the runs in .* started from"):
        bp.check_same_start({"sft_sha256": fp, "sft_eval": ev}, sft, ev, other, tmp_path)
    # recorded before fingerprints existed: the deterministic held-out evaluation decides (its time does not)
    bp.check_same_start({"sft_eval": ev}, sft, {**ev, "train_s": 600.0}, other, tmp_path)
    with pytest.raises(SystemExit, match="evaluates"):
        bp.check_same_start({"sft_eval": ev}, sft, {**ev, "greedy": 0.59}, other, tmp_path)


def test_every_run_gets_its_seeds_sync_bound_and_the_fraction_achieved():
    """Item 5 per run: the bound from the same seed's sync run (its own phase times), and the run's speed-up per
    step over that sync run as a fraction of it; a seed without a sync run has no row."""
    runs = [with_phases(fake("sync", 1, eta=0, rewards=(0.2,) * 10, wall=20.0), 1.5, 0.5, 0.4),  # 2 s / step
            with_phases(fake("sync", 2, eta=0, rewards=(0.2,) * 10, wall=40.0), 3.0, 1.0, 0.5),  # a slower machine
            fake("eta1-dec", 1, eta=1, rewards=(0.2,) * 10, wall=10.0),
            fake("eta1-dec", 2, eta=1, rewards=(0.2,) * 10, wall=25.0),
            fake("eta1-dec", 3, eta=1, rewards=(0.2,) * 10, wall=10.0)]
    assert bp.overlap_bounds({"rollout_wait_s": 1.5, "train_s": 0.5, "gen_busy": 0.4}) == pytest.approx(
        (2.0 / 1.5, 2.0 / 0.6))
    assert bp.overlap_bounds({"rollout_wait_s": None, "train_s": 1.0}) == (None, None)
    rows = {r["run"]: r for r in bp.per_run_bounds(runs)}
    assert set(rows) == {"sync_s1", "eta1-dec_s1", "sync_s2", "eta1-dec_s2"}
    a, b = rows["eta1-dec_s1"], rows["eta1-dec_s2"]
    assert a["speedup"] == pytest.approx(2.0) and a["bound"] == pytest.approx(4 / 3)
    assert a["of_bound"] == pytest.approx(1.5) and a["of_tail_bound"] == pytest.approx(2.0 / (2.0 / 0.6))
    assert b["speedup"] == pytest.approx(1.6) and b["bound_tail"] == pytest.approx(4.0 / 1.5)
    assert rows["sync_s1"]["speedup"] == pytest.approx(1.0)
    text = bp.per_run_table(bp.per_run_bounds(runs))
    assert "| eta1-dec_s2 | 2.50 | 4.00 | 1.60x | 1.33x | 2.67x | 1.20 | 0.60 |" in text
    runs[3]["cpu"], runs[1]["cpu"] = "cpu B", "cpu A"  # seed 2's async run on another machine than its sync run
    assert "eta1-dec_s2" not in {r["run"] for r in bp.per_run_bounds(runs)}
    runs[3]["cpu"] = "cpu A"
    assert "eta1-dec_s2" in {r["run"] for r in bp.per_run_bounds(runs)}


def test_the_interrupt_none_eta_is_decided_once_and_run_within_every_later_seed(tmp_path, monkeypatch):
    """The long-tail sweep's interrupt=none runs: after the first sitting's seeds have their other runs, at the eta
    that reached sync's final reward first; kept in meta.json (best_eta), so a later sitting runs it inside each of
    its seeds (same machine as that seed's sync run) and never picks another eta."""
    sft = tmp_path / "sft"
    (sft / "final_hf").mkdir(parents=True)
    (sft / "final_hf" / "model.safetensors").write_bytes(b"w")
    ev = {"greedy": 0.7, "sampled_t1": 0.4, "problems": 128, "samples": 2, "steps": 10}
    monkeypatch.setattr(bp, "ensure_sft", lambda a: (sft, ev))
    calls = []
    fast = {"sync": 3, "eta1-dec": 2, "eta2-dec": 1}  # the step at which each first has sync's final reward

    def run(v, seed, a, sft_dir):
        calls.append((v["name"], seed))
        k = fast.get(v["name"], 4)
        r = fake(v["name"], seed, eta=v["eta"], objective=v["objective"], interrupt=v["interrupt"],
                 rewards=(0.2,) * k + (0.6,) * (7 - k), wall=7.0)
        r["reward_final"] = 0.6 if v["name"] == "sync" else r["reward_final"]
        return r

    monkeypatch.setattr(bp, "run_one", run)
    out = tmp_path / "lt"
    assert bp.main(["--sweep", "longtail", "--seeds", "1", "--out", str(out)]) == 0
    assert calls[-2:] == [("eta2-dec-nointr", 1), ("eta2-dec-inplace", 1)] and len(calls) == 9
    assert json.loads((out / "meta.json").read_text())["best_eta"] == 2
    fast["eta4-dec"] = 0  # seed 2 alone would now rank eta 4 first: the kept eta is used all the same
    calls.clear()
    assert bp.main(["--sweep", "longtail", "--seeds", "2", "--out", str(out)]) == 0
    assert [c[0] for c in calls] == ["sync", "eta1-dec", "eta2-dec", "eta4-dec", "eta8-dec", "eta4-ppo",
                                     "eta8-ppo", "eta2-dec-nointr", "eta2-dec-inplace"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["best_eta"] == 2 and [len(x["variants"]) for x in meta["sweeps"]] == [9, 9]
    assert meta["sft_sha256"] == bp.sft_fingerprint(sft) and meta["sweeps"][1]["cpu"] == bp.cpu_identity()
