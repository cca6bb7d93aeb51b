"""The AReaL paper's Fig 5a/5b/5c, Fig 6b and Table 2 on the addition task, over seeds, with 95% intervals;
the root-cause controls of issue 35; and the long-tail sweep (--sweep longtail: the countdown task).

    python tools/bench_paper.py --seeds 1,2,3,4,5                        # the whole sweep (resumes)
    python tools/bench_paper.py --variants sync,eta4-dec --seeds 1 --steps 100   # a part of it
    python tools/bench_paper.py --variants 'sync,eta1-dec,stale*,*-lr4,*-mb1'   # the controls (issue 35 item 1)
    python tools/bench_paper.py --sweep longtail                         # countdown: sync vs eta 1-8 (item 3)
    python tools/bench_paper.py --sweep longtail --dry-run               # what it would run, nothing run
    python tools/bench_paper.py --sweep longtail --until 21:15           # stop between runs, before 21:15
    python tools/bench_paper.py --sweep longtail-sglang                  # item 4: the real engine, sync vs best eta
    python tools/bench_paper.py --from-results benchmarks/paper          # figures and table again, no runs

First the SFT model (`mega-async sft -c configs/addition_sft_cpu.yaml`, once: skipped when its final_hf/
exists), then one `mega-async train` per (variant, seed) from it. The long-tail sweeps start from the SFT model
shipped in benchmarks/sft/countdown/ (trained once; the SFT's outcome depends on the CPU's floating-point
kernels, so training it again on another machine gives another start): a later sitting is refused unless its
SFT weights have the sha256 meta.json recorded. Each run records its CPU (`cpu`). Variants (names; `--variants` picks some):
  sync                     max_staleness 0
  eta{E}-dec / eta{E}-ppo  asynchronous at eta E in 1, 2, 4, 8, 16; decoupled objective (prox_logp=recompute)
                           or naive PPO (prox_logp=behavior: the clip is centred on the behaviour policy)
  eta{E}-dec-nointr        rollout.interrupt=none: weight syncs wait for generation in flight (Fig 6b)
  eta{E}-dec-inplace       (long-tail sweep, by name) rollout.interrupt=in_place: the servers keep the interrupted
                           requests' KV cache, so nothing is prefilled again after a sync
  ...-unpinned             the same without CPU pinning (every other run pins the servers and the trainer
                           to disjoint halves of the CPUs: mega-async pin)
  stale{K}                 the control: synchronous (max_staleness 0) but every step trains on a batch generated K
                           versions earlier (rollout.stale_batches=K, a FIFO; no rollout overlaps training)
  ...-lr4 / ...-mb1        sync, eta1-dec and stale1 at a quarter of the config's learning rate / with one PPO
                           mini-batch (trainer.ppo_n_minibatches=1)
--sweep longtail: the countdown task (configs/countdown_{sft,rl}_cpu.yaml): sync, eta 1, 2, 4, 8 decoupled, naive
PPO at eta 4 and 8, and interrupt=none and interrupt=in_place at the eta with the shortest time to sync's final
accuracy (decided from the results once the first sitting's seeds have their other runs, then kept in meta.json as
best_eta and run within every later seed; --nointr-eta forces one).
Every table also gives the headline figures: time to sync's final reward (the first step whose TAIL-step reward
reaches the mean final reward of the sync runs) and the reward at equal wall time (at the shortest run's wall
clock), and the overlap bound from the sync runs' own phase times with the fraction of it each variant achieves.
Each finished run leaves <out>/raw/<variant>_s<seed>.json; a run whose file exists is skipped, so an
interrupted sweep continues where it stopped. Intervals: Student-t 95% over seeds (mean +- t(0.975, n-1) s/sqrt n).
Accuracy: the exact-match reward of the samples each step trains on (temperature 1; under staleness they come
from older versions) for curves and time to target; the final weights' exact match on the held-out split
(greedy, and sampled at temperature 1) for the table.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import fnmatch
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ETAS = (1, 2, 4, 8, 16)
INTERRUPT_ETAS = (4,)
TAIL = 5  # final reward = mean of the last TAIL steps
# t(0.975, df) for df = 1..30; past 30 the normal quantile is within 2%
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


# ---- variants ----------------------------------------------------------------------------------------
def _v(name: str, eta: int, objective: str = "dec", interrupt: str = "abort", pin: bool = True, stale: int = 0,
       lr_scale: float = 1.0, minibatches: Optional[int] = None) -> dict[str, Any]:
    return {"name": name, "eta": eta, "objective": objective, "interrupt": interrupt, "pin": pin, "stale": stale,
            "lr_scale": lr_scale, "minibatches": minibatches}


STALE_KS = (1, 2, 4)


def all_variants(etas: Sequence[int] = ETAS, interrupt_etas: Sequence[int] = INTERRUPT_ETAS) -> list[dict[str, Any]]:
    """The sweep: sync, decoupled and naive PPO at each eta, the non-interruptible baseline, unpinned copies of
    the throughput runs (sync and decoupled at each eta); then issue 35's controls: sync fed K-version-old
    batches (stale{K}), and sync / eta1-dec / stale1 at a quarter of the learning rate and with one mini-batch."""
    out = [_v("sync", 0)]
    for e in etas:
        out += [_v(f"eta{e}-dec", e), _v(f"eta{e}-ppo", e, "ppo")]
    out += [_v(f"eta{e}-dec-nointr", e, interrupt="none") for e in interrupt_etas]
    out += [_v("sync-unpinned", 0, pin=False)] + [_v(f"eta{e}-dec-unpinned", e, pin=False) for e in etas]
    return out + control_variants()


def control_variants() -> list[dict[str, Any]]:
    out = [_v(f"stale{k}", 0, stale=k) for k in STALE_KS]
    for suffix, kw in (("lr4", {"lr_scale": 0.25}), ("mb1", {"minibatches": 1})):
        out += [_v(f"sync-{suffix}", 0, **kw), _v(f"eta1-dec-{suffix}", 1, **kw), _v(f"stale1-{suffix}", 0, stale=1, **kw)]
    return out


LONGTAIL_ETAS = (1, 2, 4, 8)
# the long-tail sweeps export the weights every SNAPSHOT_EVERY steps (trainer.hf_snapshot_interval) and score each
# export on the held-out split after the run (outside its wall clock): held-out accuracy against wall time
SNAPSHOT_EVERY = 10
HELDOUT_WINDOW = 2  # exports averaged for the time to sync's final held-out accuracy (128 problems: +-0.04 each)
PLATEAU_EXPORTS = 5  # a run's held-out plateau: the mean of its last exports (steps 110-150 at the default cadence)
# exports [2, 5) (the 3rd to 5th): steps 30-50 at the default cadence, where sync's held-out still climbs
EARLY_EXPORTS = (2, 5)


def heldout_mean(hc: Sequence[Sequence[float]], part: slice) -> Optional[float]:
    """Mean held-out accuracy over the exports `hc[part]` (None: the run has none there)."""
    xs = [x[2] for x in hc[part]]
    return statistics.fmean(xs) if xs else None


def paired_heldout_gaps(rs: Sequence[dict], sync_of: dict[int, dict], part: slice) -> list[Optional[float]]:
    """Per run, its mean held-out accuracy over the exports `part` minus its seed's sync run's (same cadence, so the
    same steps): a per-step difference in what was learned, apart from the seeds' spread (None where either has
    no export there, or the seed no sync run)."""
    out = []
    for r in rs:
        a = heldout_mean(r["heldout_curve"], part)
        b = heldout_mean(sync_of[r["seed"]]["heldout_curve"], part) if r["seed"] in sync_of else None
        out.append(a - b if a is not None and b is not None else None)
    return out


def longtail_variants() -> list[dict[str, Any]]:
    """The long-tail sweep (issue 35 item 3): sync; eta 1, 2, 4, 8 decoupled; naive PPO at eta 4 and 8; and the
    interrupt=none candidates (one of them runs: the best eta's, see best_eta); and, by name only, the same etas
    with interrupt=in_place (the servers keep the interrupted requests' cache: nothing is prefilled again)."""
    return ([_v("sync", 0)] + [_v(f"eta{e}-dec", e) for e in LONGTAIL_ETAS] + [_v(f"eta{e}-ppo", e, "ppo") for e in (4, 8)]
            + [_v(f"eta{e}-dec-nointr", e, interrupt="none") for e in LONGTAIL_ETAS]
            + [_v(f"eta{e}-dec-inplace", e, interrupt="in_place") for e in LONGTAIL_ETAS])


SWEEPS = {  # name -> the defaults of its arguments (each may be overridden on the command line)
    "paper": {"config": "configs/addition_rl_cpu.yaml", "sft_config": "configs/addition_sft_cpu.yaml",
              "sft_dir": "runs/addition_sft/run0", "out": "benchmarks/paper", "runs_dir": "runs/bench_paper_runs",
              "steps": 150, "target": 0.7, "variants": None},
    "longtail": {"config": "configs/countdown_rl_cpu.yaml", "sft_config": "configs/countdown_sft_cpu.yaml",
                 "sft_dir": "benchmarks/sft/countdown", "out": "benchmarks/longtail",
                 "runs_dir": "runs/bench_longtail_runs", "steps": 150, "target": 0.5, "snapshots": SNAPSHOT_EVERY,
                 "variants": "sync,eta1-dec,eta2-dec,eta4-dec,eta8-dec,eta4-ppo,eta8-ppo"},
    # item 4: the long-tail headline on the real SGLang engine (its CPU build: tools/install_sglang_cpu.sh), sync
    # against the eta of the long-tail sweep that reached sync's final accuracy soonest (best_eta), 3 seeds
    "longtail-sglang": {"config": "configs/countdown_rl_cpu.yaml", "sft_config": "configs/countdown_sft_cpu.yaml",
                        "sft_dir": "benchmarks/sft/countdown", "out": "benchmarks/longtail_sglang",
                        "runs_dir": "runs/bench_longtail_sglang_runs", "steps": 150, "target": 0.5,
                        "snapshots": SNAPSHOT_EVERY, "variants": None, "seeds": "1,2,3", "engine": ["inference.backend=sglang"],
                        "best_from": "benchmarks/longtail"},
}
SWEEP_ARGS = ("config", "sft_config", "sft_dir", "out", "runs_dir", "steps", "target", "variants", "seeds",
              "snapshots")


def sweep_variants(sweep_name: str) -> list[dict[str, Any]]:
    return longtail_variants() if sweep_name.startswith("longtail") else all_variants()


def real_engine_variants(best_from: Path) -> str:
    """longtail-sglang's default --variants: sync and the decoupled eta that reached sync's final accuracy soonest
    in the long-tail sweep on the embedded server (its results under `best_from`; best_eta)."""
    runs, meta = load_results(best_from)
    eta = meta.get("best_eta") or best_eta(runs)  # the one the long-tail sweep decided and kept, else from its runs
    if eta is None:
        raise SystemExit(f"bench_paper: --sweep longtail-sglang runs sync against the best eta of the long-tail sweep, "
                         f"and {best_from} has no finished asynchronous run with its sync runs yet: run --sweep longtail first, "
                         "or pass --variants "
                         "sync,eta2-dec")
    return f"sync,eta{eta}-dec"


def variant_order() -> dict[str, int]:
    """Table order: the paper sweep's, then the long-tail sweep's own names."""
    names = dict.fromkeys(v["name"] for v in all_variants() + longtail_variants())
    return {n: i for i, n in enumerate(names)}


def pick(variants: list[dict], patterns: Optional[str]) -> list[dict]:
    """Variants whose names match any of the comma-separated glob patterns (all when None)."""
    if not patterns:
        return variants
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    out = [v for v in variants if any(fnmatch.fnmatchcase(v["name"], p) for p in pats)]
    unknown = [p for p in pats if not any(fnmatch.fnmatchcase(v["name"], p) for v in variants)]
    if unknown:
        raise SystemExit(f"bench_paper: no variant matches {', '.join(unknown)}; variants: "
                         + ", ".join(v["name"] for v in variants))
    return out


def base_lr(config: str) -> float:
    """trainer.lr of the run config (the -lr4 variants run at a quarter of it)."""
    from mega_async.api.config_load import load_config

    return float(load_config(config).trainer.lr)


def overrides(v: dict, seed: int, steps: int, runs_dir: Path, sft_dir: Path, lr: Optional[float] = None,
              snapshots: int = 0) -> list[str]:
    out = [f"rollout.max_staleness={v['eta']}", f"seed={seed}", f"trainer.total_steps={steps}",
           f"algorithm.prox_logp={'recompute' if v['objective'] == 'dec' else 'behavior'}",
           f"rollout.interrupt={v['interrupt']}", f"model.path={sft_dir / 'final_hf'}",
           f"data.path={sft_dir / 'rl_prompts.jsonl'}", f"logging.root_dir={runs_dir}",
           "experiment_name=bench_paper", f"trial_name={v['name']}_s{seed}", "logging.tensorboard=false"]
    if v.get("stale"):
        out.append(f"rollout.stale_batches={v['stale']}")
    if v.get("lr_scale", 1.0) != 1.0:
        if lr is None:
            raise ValueError(f"variant {v['name']} scales the learning rate: pass the config's lr")
        out.append(f"trainer.lr={lr * v['lr_scale']:.6g}")
    if v.get("minibatches"):
        out.append(f"trainer.ppo_n_minibatches={v['minibatches']}")
    if snapshots:
        out.append(f"trainer.hf_snapshot_interval={snapshots}")
    return out


# ---- one run ----------------------------------------------------------------------------------------
def curve(history: Sequence[dict]) -> list[list[float]]:
    """[step, elapsed_s, reward_mean, trained tokens so far, rewards summed, samples scored] per step (the last
    two cumulative over every generated sample, filtered groups too; absent without the dynamic filter)."""
    out, tokens = [], 0.0
    for h in history:
        tokens += float(h.get("train/tokens", 0.0))
        row = [int(h["step"]), float(h["elapsed_s"]), float(h["reward_mean"]), tokens]
        if "filter/reward_count" in h:
            row += [float(h["filter/reward_sum"]), float(h["filter/reward_count"])]
        out.append(row)
    return out


def window_reward(c: Sequence[Sequence[float]], i: int, window: int) -> float:
    """Exact match over the samples generated in the `window` steps ending at row i: pooled when the curve has
    the cumulative sums (a step that finished few groups weighs little), else the mean of the steps' rewards."""
    lo = i - window
    if len(c[i]) >= 6:
        s0, n0 = (c[lo][4], c[lo][5]) if lo >= 0 else (0.0, 0.0)
        if c[i][5] > n0:
            return (c[i][4] - s0) / (c[i][5] - n0)
    return statistics.fmean(r[2] for r in c[max(lo + 1, 0):i + 1])


def time_to_target(c: Sequence[Sequence[float]], target: float, window: int = 3) -> Optional[float]:
    """Elapsed seconds at the first step where the reward of the last `window` steps reaches `target`."""
    for i in range(window - 1, len(c)):
        if window_reward(c, i, window) >= target:
            return c[i][1]
    return None


DIAG = {"train/staleness": "trained tokens' staleness", "train/behav_imp_weight_mean": "behaviour weight mean",
        "train/behav_w_p01": "behaviour weight p1", "train/behav_w_p50": "behaviour weight p50",
        "train/behav_w_p99": "behaviour weight p99",
        "train/imp_weight_capped_frac": "tokens masked by the behaviour cap", "train/clip_frac": "clipped fraction",
        "train/approx_kl": "approx KL(prox or behav, new)",
        "filter/kept_frac": "filter: kept", "filter/dropped_frac": "filter: dropped",
        "filter/forced_frac": "filter: forced through", "batch/effective_groups": "groups with a gradient per step",
        "batch/adv_abs_mean": "|advantage| mean", "batch/gen_len_mean": "generated tokens / seq",
        "batch/gen_len_max_over_median": "batch max / median tokens",
        "batch/gen_s_max_over_median": "batch max / median gen seconds",
        "interrupt/per_step": "requests interrupted per step", "interrupt/resent_frac": "tokens resent / generated"}
FILTER_FRACS = ("kept", "dropped", "forced")


def diagnostics(history: Sequence[dict]) -> dict[str, float]:
    """What the objective saw over a run (means over steps): how stale the trained tokens were, the decoupled
    objective's behaviour weights pi_prox / pi_behav (mean and quantiles) and how many the cap masked, the clipped
    fraction, the KL between the clip's centre (prox, or behaviour for naive PPO) and the updated policy; the
    groups carrying a gradient after the dynamic filter and the advantage magnitudes; the generation lengths and
    their long tail; and the dynamic filter's kept / dropped / forced fractions of every group it judged."""
    out = {}
    for k in DIAG:
        vals = [float(h[k]) for h in history if isinstance(h.get(k), (int, float))]
        if vals:
            out[k] = statistics.fmean(vals)
    last = history[-1] if history else {}
    judged = sum(float(last.get(f"filter/{k}", 0.0)) for k in ("kept", "dropped"))
    if judged:
        out.update({f"filter/{k}_frac": float(last.get(f"filter/{k}", 0.0)) / judged for k in FILTER_FRACS})
    return out


def phases(history: Sequence[dict]) -> dict[str, Optional[float]]:
    """Mean seconds per step waiting for rollouts, training, and in all; and how busy an average sample kept the
    rollout wait (mean over steps of the batch's mean / max generation seconds: 1 = no long tail)."""
    def mean(key: str) -> Optional[float]:
        vals = [float(h[key]) for h in history if isinstance(h.get(key), (int, float))]
        return statistics.fmean(vals) if vals else None

    busy = [float(h["batch/gen_s_mean"]) / float(h["batch/gen_s_max"]) for h in history
            if isinstance(h.get("batch/gen_s_max"), (int, float)) and h["batch/gen_s_max"] > 0]
    return {"rollout_wait_s": mean("rollout_wait_s"), "train_s": mean("train_s"), "step_s": mean("step_s"),
            "gen_busy": statistics.fmean(busy) if busy else None}


def interruptions(run_dir: Path) -> dict[str, float]:
    """How much the weight syncs' interruptions cost a run (events.jsonl): requests interrupted per step, and the
    tokens they had generated, which go back to a server with the request (prefilled again there unless it kept
    their cache), per generated token. Empty without the files."""
    from mega_async.run.report import read_metrics

    try:
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
        history = read_metrics(run_dir)
    except (OSError, ValueError):
        return {}
    cut = [e for e in events if e.get("kind") == "episode_interrupted"]
    generated = float(history[-1].get("executor/output_tokens") or 0.0) if history else 0.0
    out = {"interrupt/per_step": len(cut) / max(len(history), 1)}
    if generated:
        out["interrupt/resent_frac"] = sum(int(e.get("tokens") or 0) for e in cut) / generated
    return out


def backfill_diagnostics(out: Path, runs_dir: Path) -> int:
    """Raw results without diagnostics (or without the interruption figures) get them from their run's
    metrics.jsonl and events.jsonl when they are still there; returns how many were filled."""
    from mega_async.run.report import read_metrics

    n = 0
    for p in sorted((out / "raw").glob("*.json")):
        r = json.loads(p.read_text())
        run_dir = runs_dir / "bench_paper" / p.stem
        done = r.get("diag") and ("interrupt/per_step" in r["diag"] or not (run_dir / "events.jsonl").is_file())
        if done or not (run_dir / "metrics.jsonl").is_file():
            continue
        r["diag"] = {**(r.get("diag") or diagnostics(read_metrics(run_dir))), **interruptions(run_dir)}
        tmp = p.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(r) + "\n")
        tmp.replace(p)
        n += 1
    return n


def run_figures(history: Sequence[dict], target: float) -> dict[str, Any]:
    """The figures of one run from its metrics (mega_async.run.report.summarize plus the paper's)."""
    from mega_async.run.report import summarize

    s = summarize(history, reward_threshold=target, tail=TAIL)
    c = curve(history)
    wall = s["wall_s"]
    return {"wall_s": wall, "reward_final": s["reward_final"], "time_to_target_s": time_to_target(c, target),
            "gen_tokens_per_s": s["gen_tokens_per_s"], "gen_groups_per_s": s["gen_groups_per_s"],
            "trained_tokens_per_s": c[-1][3] / wall if wall else None,  # the paper's effective training throughput
            "staleness_mean": s["staleness_mean"], "token_staleness_mean": s["token_staleness_mean"],
            "sync_s": s["sync_s"], "split": s.get("split"), "diag": diagnostics(history), "phases": phases(history),
            "generation": {k: s[k] for k in ("gen_len_mean", "gen_len_max", "gen_len_max_over_median",
                                             "gen_s_max_over_median") if k in s}, "curve": c}


def run_one(v: dict, seed: int, a: argparse.Namespace, sft_dir: Path) -> dict[str, Any]:
    """One `mega-async train` in a subprocess (pinned through `mega-async pin` when the variant says so),
    then the final weights scored on the held-out split."""
    from mega_async.run.report import read_metrics

    runs_dir = Path(a.runs_dir).resolve()
    trial = f"{v['name']}_s{seed}"
    shutil.rmtree(runs_dir / "bench_paper" / trial, ignore_errors=True)  # a run cut short starts again
    cmd = train_command(v, seed, a, runs_dir, sft_dir)
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=a.timeout,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"run {trial} failed (exit {r.returncode}): {tail}")
    run_dir = runs_dir / "bench_paper" / trial
    history = read_metrics(run_dir)
    out = {**v, "seed": seed, "steps": a.steps, "cpu": cpu_identity(), "process_s": round(time.monotonic() - t0, 2),
           **run_figures(history, a.target)}
    out["diag"].update(interruptions(run_dir))
    out["final_eval"] = final_eval(run_dir / "final_hf", sft_dir / "eval.jsonl", seed)
    if (run_dir / "hf_snapshots").is_dir():
        out["heldout_curve"] = heldout_curve(run_dir / "hf_snapshots", history, sft_dir / "eval.jsonl")
    out["total_s"] = round(time.monotonic() - t0, 2)  # the run and its scoring: what a sitting's deadline needs
    return out


def cpu_identity() -> str:
    """The CPU model this run had, with its widest vector extension: training numerics and speed depend on it, so
    runs from different machines are told apart (timings compared within one machine; see the headline's
    per-seed pairing)."""
    name, fam, model, flags = "unknown", "?", "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, val = line.partition(":")
            k, val = k.strip(), val.strip()
            if k == "model name" and name == "unknown":
                name = val
            elif k == "cpu family" and fam == "?":
                fam = val
            elif k == "model" and model == "?":
                model = val
            elif k == "flags" and not flags:
                flags = set(val.split())
    except OSError:
        pass
    isa = next((x for x in ("avx512f", "avx2", "avx", "sse4_2") if x in flags), "")
    return f"{name} (family {fam} model {model}{', ' + isa if isa else ''})"


def heldout_curve(snap_dir: Path, history: Sequence[dict], eval_file: Path) -> list[list[float]]:
    """[step, elapsed_s, held-out greedy exact match] of every weight export under `snap_dir` (step_<N>: the
    weights after step N; elapsed_s is that step's end in metrics.jsonl), in step order."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mega_async.data import load_rows
    from mega_async.run.sft import exact_match

    torch.set_num_threads(1)
    items = load_rows(eval_file)
    elapsed = {int(h["step"]): float(h["elapsed_s"]) for h in history}
    out = []
    for step, d in sorted((int(p.name[5:]), p) for p in snap_dir.glob("step_*") if p.name[5:].isdigit()):
        if step not in elapsed:
            continue  # a step the metrics do not have (a resumed run's lost tail): no time to put it at
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, use_safetensors=True)
        out.append([step, elapsed[step], exact_match(model, items, AutoTokenizer.from_pretrained(str(d)))])
    return out


def time_to_heldout(hc: Sequence[Sequence[float]], target: float, window: int = HELDOUT_WINDOW) -> Optional[float]:
    """Elapsed seconds at the first export where the held-out accuracy of the last `window` exports reaches
    `target` (None: never)."""
    for i in range(window - 1, len(hc)):
        if statistics.fmean(x[2] for x in hc[i - window + 1:i + 1]) >= target - 1e-9:  # a tie counts
            return hc[i][1]
    return None


def heldout_at_time(hc: Sequence[Sequence[float]], t: float) -> Optional[float]:
    """Held-out accuracy of the last export made by elapsed second `t` (None: none was)."""
    return next((x[2] for x in reversed(hc) if x[1] <= t), None)


def train_command(v: dict, seed: int, a: argparse.Namespace, runs_dir: Path, sft_dir: Path) -> list[str]:
    """The `mega-async train` command line of one (variant, seed) (pinned through `mega-async pin` or not)."""
    entry = ["-m", "mega_async.cli", "pin", "--"] if v["pin"] else ["-m", "mega_async.cli"]
    lr = base_lr(a.config) if v.get("lr_scale", 1.0) != 1.0 else None
    return [sys.executable, *entry, "train", "-c", a.config,
            *overrides(v, seed, a.steps, runs_dir, sft_dir, lr, getattr(a, "snapshots", 0) or 0), *a.overrides]


def final_eval(model_dir: Path, eval_file: Path, seed: int) -> dict[str, float]:
    import torch

    from mega_async.data import load_rows
    from mega_async.run.sft import evaluate_dir

    torch.set_num_threads(1)
    return evaluate_dir(model_dir, load_rows(eval_file), samples=4, seed=seed)


def ensure_sft(a: argparse.Namespace) -> tuple[Path, dict]:
    """The SFT run directory (trained now unless its final_hf/ exists) and its held-out evaluation."""
    sft_dir = Path(a.sft_dir)
    if not (sft_dir / "final_hf" / "config.json").exists():
        root, exp, trial = sft_dir.parent.parent, sft_dir.parent.name, sft_dir.name
        cmd = [sys.executable, "-m", "mega_async.cli", "sft", "-c", a.sft_config, f"logging.root_dir={root}",
               f"experiment_name={exp}", f"trial_name={trial}"]
        print("sft:", " ".join(cmd), flush=True)
        shutil.rmtree(sft_dir, ignore_errors=True)
        subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return sft_dir, json.loads((sft_dir / "sft_eval.json").read_text())


def sft_fingerprint(sft_dir: Path) -> str:
    """sha256 over the SFT model's weight files (final_hf/*.safetensors, by name): which start the runs share."""
    h = hashlib.sha256()
    for f in sorted((sft_dir / "final_hf").glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


SFT_EVAL_KEYS = ("greedy", "sampled_t1", "problems", "samples", "steps")


def check_same_start(before: dict, sft_dir: Path, sft_eval: dict, fingerprint: str, out: Path) -> None:
    """A later sitting must start from the SFT model the recorded runs started from (its run directory may have
    been trained again, e.g. on a fresh machine): the weights' sha256 where it was recorded, else the held-out
    evaluation, which is deterministic; a mismatch is refused in one line."""
    known = before.get("sft_sha256")
    if known and known != fingerprint:
        raise SystemExit(f"bench_paper: the SFT model in {sft_dir} (sha256 {fingerprint[:12]}) is not the one the "
                         f"runs in {out} started from (sha256 {known[:12]}); restore that SFT run, or pass another "
                         f"--out for a sweep from this one")
    old = before.get("sft_eval")
    if not known and old:
        a, b = ({k: e.get(k) for k in SFT_EVAL_KEYS} for e in (old, sft_eval))
        if a != b:
            raise SystemExit(f"bench_paper: the SFT model in {sft_dir} evaluates {b}, the one the runs in {out} "
                             f"started from {a}; restore that SFT run, or pass another --out for a sweep from this one")


# ---- the sweep ----------------------------------------------------------------------------------------
def until(text: str, now: Optional[float] = None) -> float:
    """The deadline `--until` names, as a time.time() value: HH:MM on the local clock (its next occurrence), or a
    duration from now (90m, 2h30m, 5400s, 1h)."""
    now = time.time() if now is None else now
    t = text.strip().lower()
    if m := re.fullmatch(r"([01]?\d|2[0-3]):([0-5]\d)", t):
        base = datetime.datetime.fromtimestamp(now)
        at = base.replace(hour=int(m[1]), minute=int(m[2]), second=0, microsecond=0)
        if at.timestamp() <= now:
            at += datetime.timedelta(days=1)
        return at.timestamp()
    if t and (m := re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", t)) and any(m.groups()):
        h, mi, sec = (int(x or 0) for x in m.groups())
        return now + 3600 * h + 60 * mi + sec
    raise SystemExit(f"bench_paper: --until {text!r} is neither a clock time (21:15) nor a duration (90m, 2h30m, "
                     "5400s)")


def raw_path(out: Path, name: str, seed: int) -> Path:
    return out / "raw" / f"{name}_s{seed}.json"


def sweep(variants: list[dict], seeds: Sequence[int], out: Path, runner: Callable[[dict, int], dict[str, Any]],
          deadline: Optional[float] = None, clock: Callable[[], float] = time.time
          ) -> tuple[list[dict], list[str], list[str]]:
    """Every (variant, seed) whose raw result is missing, seeds outermost (a drift in machine load hits every
    variant alike; a seed's runs share a sitting, so a machine, and pair with its sync run); returns (all results
    found or made, failures, runs not started). Each result is written as it finishes. With a `deadline` (a
    `clock()` time), a seed none of whose missing runs has started yet starts only if all of them fit before it,
    and no run starts that would end after it. A run is expected to take what that variant took at most, this call
    or as recorded under `out` (total_s, scoring included; process_s for older results), else the longest run
    of any variant: a sweep spread over several sittings stops between seeds, losing none."""
    results, failed, skipped = [], [], []
    took: dict[str, float] = {}
    recorded = [json.loads(p.read_text()) for p in sorted((out / "raw").glob("*.json"))] if deadline else []
    for r in recorded:
        took[r["name"]] = max(took.get(r["name"], 0.0), float(r.get("total_s") or r.get("process_s") or 0.0))

    def expect(name: str) -> float:
        return took.get(name) or max(took.values(), default=0.0)

    for seed in seeds:
        todo = [v for v in variants if not raw_path(out, v["name"], seed).exists()]
        if deadline is not None and todo and not skipped and clock() + sum(expect(v["name"]) for v in todo) > deadline:
            skipped += [f"{v['name']}_s{seed}" for v in todo]  # the whole seed is for a later sitting
        for v in variants:
            p = raw_path(out, v["name"], seed)
            if p.exists():
                results.append(json.loads(p.read_text()))
                continue
            name = f"{v['name']}_s{seed}"
            if name in skipped:
                continue
            if skipped or (deadline is not None and clock() + expect(v["name"]) > deadline):
                skipped.append(name)
                continue
            t0 = clock()
            try:
                r = runner(v, seed)
            except (RuntimeError, subprocess.SubprocessError) as e:
                print(f"{v['name']} seed {seed}: FAILED: {e}", flush=True)
                failed.append(f"{v['name']}_s{seed}: {e}")
                continue
            finally:
                took[v["name"]] = max(took.get(v["name"], 0.0), clock() - t0)
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(r) + "\n")
            tmp.replace(p)
            results.append(r)
            fe = r.get("final_eval") or {}
            print(f"{v['name']} seed {seed}: wall {r['wall_s']:.0f}s, final reward {r['reward_final']:.3f}, "
                  f"held-out greedy {fe.get('greedy', float('nan')):.3f}, time to target {r['time_to_target_s']}",
                  flush=True)
    if skipped:
        print(f"bench_paper: the deadline stops the sweep before {skipped[0]}; {len(skipped)} runs not started "
              "(run the same command again to continue)", flush=True)
    return results, failed, skipped


def load_results(path: Path) -> tuple[list[dict], dict]:
    """Raw results and meta from an output directory (raw/*.json, meta.json) or a runs.json (none: nothing yet)."""
    if not path.exists():
        return [], {}
    if path.is_dir():
        runs = [json.loads(p.read_text()) for p in sorted((path / "raw").glob("*.json"))]
        meta_p = path / "meta.json"
        return runs, json.loads(meta_p.read_text()) if meta_p.exists() else {}
    saved = json.loads(path.read_text())
    return saved["runs"], saved.get("meta", {})


# ---- statistics ---------------------------------------------------------------------------------------
def t_interval(values: Sequence[Optional[float]]) -> dict[str, Any]:
    """Mean and Student-t 95% half-width over the non-None values (half-width None with fewer than 2)."""
    vals = [float(x) for x in values if x is not None]
    n = len(vals)
    if not n:
        return {"mean": None, "ci95": None, "n": 0, "values": []}
    mean = statistics.fmean(vals)
    half = None
    if n >= 2:
        t = T975[n - 2] if n - 1 <= len(T975) else 1.96
        half = t * statistics.stdev(vals) / math.sqrt(n)
    return {"mean": mean, "ci95": half, "n": n, "values": vals}


def reward_at(c: Sequence[Sequence[float]], step: int, window: int = TAIL) -> Optional[float]:
    """Reward over the `window` steps ending at `step` (window_reward; None when the run is shorter)."""
    i = next((k for k, r in enumerate(c) if r[0] == step), None)
    return window_reward(c, i, window) if i is not None else None


def aggregate(runs: list[dict]) -> list[dict[str, Any]]:
    """Per variant: each figure's mean and 95% interval over seeds; time to target counts the seeds that got
    there; accuracy at the step every run of the variant reached (the same-step comparison)."""
    rows = []
    order = variant_order()
    for name in sorted(dict.fromkeys(r["name"] for r in runs), key=lambda n: (order.get(n, len(order)), n)):
        rs = [r for r in runs if r["name"] == name]
        first = rs[0]
        same = min(r["curve"][-1][0] for r in rs)
        row = {k: first.get(k) for k in ("name", "eta", "objective", "interrupt", "pin", "stale")}
        row.update(seeds=sorted(r["seed"] for r in rs), same_step=same,
                   reached=sum(r["time_to_target_s"] is not None for r in rs))
        for f in ("wall_s", "reward_final", "time_to_target_s", "gen_tokens_per_s", "gen_groups_per_s",
                  "trained_tokens_per_s", "staleness_mean"):
            row[f] = t_interval([r.get(f) for r in rs])
        row["acc_same_step"] = t_interval([reward_at(r["curve"], same) for r in rs])
        for k in ("greedy", "sampled_t1"):
            row[f"eval_{k}"] = t_interval([(r.get("final_eval") or {}).get(k) for r in rs])
        rows.append(row)
    return rows


def reward_at_time(c: Sequence[Sequence[float]], t: float, window: int = TAIL) -> Optional[float]:
    """Reward over the `window` steps ending at the last step finished by elapsed second `t` (None: none was)."""
    i = max((k for k, r in enumerate(c) if r[1] <= t), default=None)
    return window_reward(c, i, window) if i is not None else None


def overlap_bounds(ph: dict) -> tuple[Optional[float], Optional[float]]:
    """The overlap bound from a sync run's phase times, (rollout + train) / max(rollout, train), and adjusted for
    the long tail, (rollout + train) / max(rollout * busy, train); (None, None) without them."""
    r_, t_, busy = ph.get("rollout_wait_s"), ph.get("train_s"), ph.get("gen_busy")
    if r_ is None or t_ is None or max(r_, t_) <= 0:
        return None, None
    return (r_ + t_) / max(r_, t_), (r_ + t_) / max(r_ * (busy if busy is not None else 1.0), t_)


def same_machine(a: dict, b: dict) -> bool:
    """Whether two runs ran on the same kind of CPU (as far as recorded: results from before `cpu` pair)."""
    return not a.get("cpu") or not b.get("cpu") or a["cpu"] == b["cpu"]


def per_run_bounds(runs: list[dict]) -> list[dict[str, Any]]:
    """Item 5, for every run: its step time against its seed's sync run (same seed, same sitting, so the same
    machine; a run whose recorded CPU differs from that sync run's has no row), that sync run's overlap bound and
    long-tail bound, and the fraction of each the run achieves."""
    sync = {r["seed"]: r for r in runs if r["name"] == "sync"}
    order = variant_order()
    rows = []
    for r in sorted(runs, key=lambda r: (r["seed"], order.get(r["name"], 10**6), r["name"])):
        s = sync.get(r["seed"])
        if s is None or not r.get("curve") or not s.get("curve") or not same_machine(r, s):
            continue
        step, s_step = r["wall_s"] / len(r["curve"]), s["wall_s"] / len(s["curve"])
        b, bt = overlap_bounds(s.get("phases") or {})
        sp = s_step / step if step else None
        rows.append({"run": f"{r['name']}_s{r['seed']}", "step_s": step, "sync_step_s": s_step, "speedup": sp,
                     "bound": b, "bound_tail": bt, "of_bound": sp / b if sp and b else None,
                     "of_tail_bound": sp / bt if sp and bt else None})
    return rows


TIMES = "{:.2f}x"  # a ratio in the tables


def _num(x: Optional[float], fmt: str = "{:.2f}") -> str:
    """A table cell: the number in `fmt`, or "-" where there is none."""
    return "-" if x is None else fmt.format(x)


def per_run_table(rows: list[dict]) -> str:
    f, x = _num, TIMES
    lines = ["| run | s / step | its seed's sync s / step | speed-up | bound (sync's phases) | long-tail bound | "
             "of bound | of long-tail bound |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {f(r['step_s'])} | {f(r['sync_step_s'])} | {f(r['speedup'], x)} | "
                     f"{f(r['bound'], x)} | {f(r['bound_tail'], x)} | {f(r['of_bound'])} | {f(r['of_tail_bound'])} |")
    return "\n".join(lines)


def headline(runs: list[dict]) -> dict[str, Any]:
    """The sweep's headline against its sync runs: sync's final reward (mean over its seeds of the last TAIL
    steps) and per variant the time to reach it; with scored exports, sync's final held-out accuracy (mean over
    its seeds), the time each variant's held-out accuracy (HELDOUT_WINDOW exports averaged) first reaches it
    (sync's own: its end, where it has it) and the speed-up over sync's end; the reward at equal wall time (the shortest run's wall clock,
    which every run reached), the step-time speed-up over sync, and the overlap bound from the sync runs' own
    phase times: (rollout + train) / max(rollout, train), and adjusted for the long tail, where the rollout counts
    only the share of its wait an average sample was generating (a full pipeline fills the rest):
    (rollout + train) / max(rollout * busy, train). Empty without sync runs."""
    sync = [r for r in runs if r["name"] == "sync"]
    if not sync:
        return {}
    target = statistics.fmean(r["reward_final"] for r in sync)
    t_eq = min(r["curve"][-1][1] for r in runs)
    ph = [r.get("phases") or {} for r in sync]
    R = [p["rollout_wait_s"] for p in ph if p.get("rollout_wait_s") is not None]
    T = [p["train_s"] for p in ph if p.get("train_s") is not None]
    busy = [p["gen_busy"] for p in ph if p.get("gen_busy") is not None]
    bound, bound_tail = overlap_bounds({"rollout_wait_s": statistics.fmean(R) if R else None,
                                        "train_s": statistics.fmean(T) if T else None,
                                        "gen_busy": statistics.fmean(busy) if busy else None})
    sync_step = statistics.fmean(r["wall_s"] / len(r["curve"]) for r in sync)
    per: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["name"] for r in runs):
        rs = [r for r in runs if r["name"] == name]
        tt = [time_to_target(r["curve"], target, TAIL) for r in rs]
        step = t_interval([r["wall_s"] / len(r["curve"]) for r in rs])
        speed = sync_step / step["mean"] if step["mean"] else None
        per[name] = {"time_to_sync_final_s": t_interval(tt), "reached": sum(t is not None for t in tt),
                     "acc_equal_wall": t_interval([reward_at_time(r["curve"], t_eq) for r in rs]),
                     "step_s": step, "speedup": speed,
                     "fraction_of_bound": speed / bound if speed and bound else None,
                     "fraction_of_tail_bound": speed / bound_tail if speed and bound_tail else None}
    held = [r["final_eval"]["greedy"] for r in sync if (r.get("final_eval") or {}).get("greedy") is not None
            and r.get("heldout_curve")]
    target_h = statistics.fmean(held) if held else None
    if target_h is not None:
        # sync has its final accuracy at its end: that is the time to beat (the crossing rule below, applied to
        # sync itself, finds the target wherever two exports average above it, or nowhere: reported beside it)
        sync_t = statistics.fmean(r["wall_s"] for r in sync if r.get("heldout_curve"))
        sync_of = {r["seed"]: r for r in sync if r.get("heldout_curve")}
        plateau, early = slice(-PLATEAU_EXPORTS, None), slice(*EARLY_EXPORTS)
        for name, v in per.items():
            rs = [r for r in runs if r["name"] == name and r.get("heldout_curve")]
            if not rs:
                continue  # recorded without exports (--snapshots 0, or before them): the reward figures only
            th = [r["wall_s"] if name == "sync" else time_to_heldout(r["heldout_curve"], target_h) for r in rs]
            ti = t_interval(th)
            # the same speed-up paired by seed: each seed's sync end over this variant's time at that seed (a seed's
            # runs share a sitting, so a machine; where the seed's sync ran on the same CPU and the variant reached
            # the target)
            paired = [sync_of[r["seed"]]["wall_s"] / t for r, t in zip(rs, th)
                      if t and r["seed"] in sync_of and same_machine(r, sync_of[r["seed"]])]
            mine = name != "sync"  # sync against itself: no paired gap
            v.update({"time_to_sync_heldout_s": ti, "reached_heldout": sum(t is not None for t in th),
                      "heldout_runs": len(rs),
                      "heldout_plateau": t_interval([heldout_mean(r["heldout_curve"], plateau) for r in rs]),
                      "heldout_plateau_paired": t_interval(paired_heldout_gaps(rs, sync_of, plateau) if mine else []),
                      "heldout_early_paired": t_interval(paired_heldout_gaps(rs, sync_of, early) if mine else []),
                      "heldout_speedup": sync_t / ti["mean"] if sync_t and ti["mean"] else None,
                      "heldout_speedup_paired": t_interval(paired),
                      "heldout_equal_wall": t_interval([heldout_at_time(r["heldout_curve"], t_eq) for r in rs]),
                      "heldout_final": t_interval([(r.get("final_eval") or {}).get("greedy") for r in rs])})
            if name == "sync":  # the crossing rule applied to sync itself: how hard the target is for any run
                by_rule = [time_to_heldout(r["heldout_curve"], target_h) for r in rs]
                v.update({"crossing_s": t_interval(by_rule), "reached_crossing": sum(t is not None for t in by_rule)})
    return {"sync_final_reward": target, "equal_wall_s": t_eq, "bound": bound, "bound_tail": bound_tail,
            "sync_final_heldout": target_h,
            "sync_rollout_wait_frac": (statistics.fmean(R) / (statistics.fmean(R) + statistics.fmean(T))
                                       if R and T else None), "variants": per}


def headline_table(h: dict[str, Any], order: Sequence[str], snapshots: Optional[int] = None) -> str:
    """Markdown: per variant the time to sync's final reward, the reward at equal wall time, the speed-up per step
    and the fraction of the overlap bound it achieves."""
    if not h:
        return "(no sync runs: no headline)"
    f, x = _num, TIMES
    lines = [f"Sync's final reward {h['sync_final_reward']:.3f} (mean of its last {TAIL} steps over seeds); equal wall "
             f"time {h['equal_wall_s']:.0f} s; overlap bound from sync's phases {f(h['bound'], x)}, long-tail "
             f"adjusted {f(h['bound_tail'], x)} (sync waits for rollouts {f(h['sync_rollout_wait_frac'])} of rollout "
             "+ train).",
             "", "| variant | time to sync's final reward s (seeds reaching) | reward at equal wall time | s / step | "
             "speed-up per step | of bound | of long-tail bound |", "|---|---|---|---|---|---|---|"]
    for name in order:
        v = h["variants"].get(name)
        if v is None:
            continue
        n = v["step_s"]["n"]
        lines.append(f"| {name} | {_ci(v['time_to_sync_final_s'], '{:.0f}')} ({v['reached']}/{n}) | "
                     f"{_ci(v['acc_equal_wall'])} | {_ci(v['step_s'], '{:.2f}')} | {f(v['speedup'], x)} | "
                     f"{f(v['fraction_of_bound'])} | {f(v['fraction_of_tail_bound'])} |")
    if h.get("sync_final_heldout") is not None:
        every = f"every {snapshots} steps" if snapshots else "at intervals"
        lines += ["", f"Held-out (greedy exact match of the weights exported {every} and at the end, scored after "
                  f"the run; the mean of {HELDOUT_WINDOW} consecutive exports): sync's final held-out accuracy "
                  f"{h['sync_final_heldout']:.3f} (mean over seeds).", "",
                  "| variant | time to sync's final held-out s (seeds reaching; sync: its end) | speed-up over sync | "
                  f"speed-up paired by seed | held-out at equal wall time | held-out plateau (last {PLATEAU_EXPORTS} "
                  f"exports) | plateau minus sync's, paired | exports {EARLY_EXPORTS[0] + 1}-{EARLY_EXPORTS[1]} minus "
                  "sync's, paired | final held-out |", "|---|---|---|---|---|---|---|---|---|"]
        for name in order:
            v = h["variants"].get(name)
            if v is None or "time_to_sync_heldout_s" not in v:
                continue
            lines.append(f"| {name} | {_ci(v['time_to_sync_heldout_s'], '{:.0f}')} ({v['reached_heldout']}/"
                         f"{v['heldout_runs']}) | {f(v['heldout_speedup'], x)} | "
                         f"{_ci(v['heldout_speedup_paired'], x) if name != 'sync' else '-'} | "
                         f"{_ci(v['heldout_equal_wall'])} | {_ci(v['heldout_plateau'])} | "
                         + (f"{_ci(v['heldout_plateau_paired'], '{:+.3f}')} | "
                            f"{_ci(v['heldout_early_paired'], '{:+.3f}')} | " if name != "sync" else "- | - | ")
                         + f"{_ci(v['heldout_final'])} |")
        s = h["variants"].get("sync") or {}
        if "crossing_s" in s:
            lines += ["", f"The same crossing rule applied to sync itself reaches {h['sync_final_heldout']:.3f} in "
                      f"{s['reached_crossing']} of {s['heldout_runs']} seeds"
                      + (f" (at {s['crossing_s']['mean']:.0f} s on average)" if s["reached_crossing"] else "")
                      + f": the target is the mean of sync's final exports, against a plateau of "
                      f"{_ci(s['heldout_plateau'])} over its last {PLATEAU_EXPORTS}."]
    return "\n".join(lines)


def best_eta(runs: list[dict]) -> Optional[int]:
    """The decoupled, interruptible eta that reaches sync's final accuracy soonest: held-out when every candidate's
    runs have their exports scored (else the train reward, for all); most seeds reaching first, then the shortest
    mean time; None before any has results."""
    h = headline(runs)
    found = [(r["eta"], v) for r in {r["name"]: r for r in runs if r["eta"] > 0 and r["objective"] == "dec"
                                     and r["interrupt"] == "abort" and r["pin"] and not r.get("stale")
                                     and r.get("lr_scale", 1.0) == 1.0 and not r.get("minibatches")}.values()
             if (v := (h.get("variants") or {}).get(r["name"]))]
    held = bool(found) and all("time_to_sync_heldout_s" in v for _, v in found)  # one ranking for all of them
    key, reached = ("time_to_sync_heldout_s", "reached_heldout") if held else ("time_to_sync_final_s", "reached")
    cands = []
    for eta, v in found:
        t = v[key]["mean"]
        cands.append((-v[reached], t if t is not None else math.inf, eta))
    return min(cands)[2] if cands else None


def _ci(s: dict, fmt: str = "{:.3f}") -> str:
    if s["mean"] is None:
        return "-"
    half = f" ± {fmt.replace('+', '').format(s['ci95'])}" if s["ci95"] is not None else " (1 seed)"
    return fmt.format(s["mean"]) + half


def table2(rows: list[dict], meta: dict) -> str:
    """Markdown: per variant the final held-out accuracy, final reward, accuracy at the same step, wall clock,
    time to target, throughput; mean ± 95% t-interval half-width over seeds."""
    target = meta.get("target", "?")
    sync = next((r for r in rows if r["name"] == "sync"), None)
    head = ["variant", "eta", "objective", "interrupt", "pinned", "seeds", "held-out acc (greedy)",
            "held-out acc (t=1)", f"train reward, last {TAIL} steps", "reward at same step (step)", "wall clock s",
            "speed-up vs sync", f"time to reward {target} s (seeds reaching)", "trained tokens/s", "gen tokens/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        sp = "-"
        if sync is not None and sync["wall_s"]["mean"] and r["wall_s"]["mean"]:
            sp = f"{sync['wall_s']['mean'] / r['wall_s']['mean']:.2f}x"
        lines.append("| " + " | ".join([
            r["name"], str(r["eta"]), (f"sync fed {r['stale']}-version-old batches" if r.get("stale") else
                                       "(same at eta 0)") if r["eta"] == 0 else
            ("decoupled" if r["objective"] == "dec" else "naive PPO"), r["interrupt"],
            "yes" if r["pin"] else "no", str(len(r["seeds"])), _ci(r["eval_greedy"]), _ci(r["eval_sampled_t1"]),
            _ci(r["reward_final"]), f"{_ci(r['acc_same_step'])} ({r['same_step']})", _ci(r["wall_s"], "{:.0f}"), sp,
            f"{_ci(r['time_to_target_s'], '{:.0f}')} ({r['reached']}/{len(r['seeds'])})",
            _ci(r["trained_tokens_per_s"], "{:.0f}"), _ci(r["gen_tokens_per_s"], "{:.0f}")]) + " |")
    return "\n".join(lines)


PER_STEP = (10, 30, 80, 140)  # the steps of issue 35's per-step comparison


def per_step_table(runs: list[dict], steps: Sequence[int] = PER_STEP, window: int = TAIL) -> str:
    """Markdown: per variant the train reward over the `window` steps ending at each of `steps` (mean ± 95%
    interval over seeds) and its gap to sync's, paired by seed (the same seed is the same SFT start and prompt
    order, so the pairing takes the seeds' spread out of the gap); steps a variant's runs did not reach are left
    out."""
    order = variant_order()
    names = sorted({r["name"] for r in runs}, key=lambda n: (order.get(n, len(order)), n))
    sync = {r["seed"]: r for r in runs if r["name"] == "sync"}
    head = ["variant", "seeds"] + [f"step {s}" for s in steps] + [f"gap to sync, step {s} (paired seeds)"
                                                                  for s in steps]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        rs = [r for r in runs if r["name"] == name]
        cells = [_ci(t_interval([reward_at(r["curve"], s, window) for r in rs])) for s in steps]
        gaps = []
        for s in steps:
            pairs = [(reward_at(r["curve"], s, window), reward_at(sync[r["seed"]]["curve"], s, window))
                     for r in rs if r["seed"] in sync]
            d = t_interval([a - b for a, b in pairs if a is not None and b is not None])
            if name == "sync" or d["mean"] is None:
                gaps.append("-")
            else:
                half = f" ± {d['ci95']:.3f}" if d["ci95"] is not None else ""
                gaps.append(f"{d['mean']:+.3f}{half} ({d['n']})")
        lines.append("| " + " | ".join([name, str(len(rs))] + cells + gaps) + " |")
    return "\n".join(lines)


def diagnostics_table(runs: list[dict]) -> str:
    """Markdown: per variant the mean over seeds (those whose runs recorded them) of each diagnostic."""
    order = variant_order()
    names = sorted({r["name"] for r in runs if r.get("diag")}, key=lambda n: (order.get(n, len(order)), n))
    head = ["variant", "seeds"] + list(DIAG.values())
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        rs = [r for r in runs if r["name"] == name and r.get("diag")]
        cells = [_ci(t_interval([r["diag"].get(k) for r in rs]), "{:.4g}") for k in DIAG]
        lines.append("| " + " | ".join([name, str(len(rs))] + cells) + " |")
    return "\n".join(lines)


# ---- figures ------------------------------------------------------------------------------------------
def _mean_curve(rs: list[dict], col: int) -> tuple[list[float], list[float], list[float]]:
    """x = step (col 0) or wall clock (col 1); the reward of the last TAIL steps (window_reward), mean over seeds
    and its 95% band, over the steps every seed has."""
    n = min(len(r["curve"]) for r in rs)
    xs, mean, half = [], [], []
    for i in range(n):
        s = t_interval([window_reward(r["curve"], i, TAIL) for r in rs])
        xs.append(statistics.fmean(r["curve"][i][col] for r in rs))
        mean.append(s["mean"])
        half.append(s["ci95"] or 0.0)
    return xs, mean, half


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def plot_curves(runs: list[dict], objective: str, out: Path, title: str) -> Path:
    """Fig 5a (naive PPO) / 5b (decoupled): reward against step and against wall clock, sync and every eta,
    pinned runs with interruption; mean over seeds with the 95% band."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    pick_ = [r for r in runs if r["pin"] and r["interrupt"] == "abort" and (r["eta"] == 0 or r["objective"] == objective)]
    for eta in sorted({r["eta"] for r in pick_}):
        rs = [r for r in pick_ if r["eta"] == eta]
        label = "sync (eta 0)" if eta == 0 else f"eta {eta}"
        for ax, col in ((a, 0), (b, 1)):
            xs, m, h = _mean_curve(rs, col)
            line, = ax.plot(xs, m, lw=1.5, label=f"{label} ({len(rs)} seeds)")
            ax.fill_between(xs, [x - y for x, y in zip(m, h)], [x + y for x, y in zip(m, h)],
                            color=line.get_color(), alpha=0.15)
    a.set(xlabel="training step", ylabel="exact-match reward (t=1)", title=f"{title}: reward per step")
    b.set(xlabel="wall clock (s)", ylabel="exact-match reward (t=1)", title=f"{title}: reward per second")
    a.legend(fontsize=8)
    return _save(plt, fig, out)


def plot_headline(runs: list[dict], order: Sequence[str], out: Path) -> Optional[Path]:
    """The headline figure (runs with scored exports only): held-out accuracy against wall clock per variant (mean
    over seeds at each export, at its mean time, with the 95% band; sync's final held-out dashed), and the time
    to sync's final held-out accuracy per variant (mean and 95% interval over the seeds reaching it)."""
    h = headline(runs)
    if not h or h.get("sync_final_heldout") is None:
        return None
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    names = [n for n in order if "time_to_sync_heldout_s" in h["variants"].get(n, {})]
    for name in names:
        rs = [r for r in runs if r["name"] == name and r.get("heldout_curve")]
        at = [{int(x[0]): x for x in r["heldout_curve"]} for r in rs]
        steps = sorted(set.intersection(*(set(d) for d in at)))  # the exports every seed has, step by step
        xs = [statistics.fmean(d[k][1] for d in at) for k in steps]
        st = [t_interval([d[k][2] for d in at]) for k in steps]
        m, half = [x["mean"] for x in st], [x["ci95"] or 0.0 for x in st]
        line, = a.plot(xs, m, lw=1.5, marker=".", label=f"{name} ({len(rs)} seeds)")
        a.fill_between(xs, [x - y for x, y in zip(m, half)], [x + y for x, y in zip(m, half)],
                       color=line.get_color(), alpha=0.12)
    a.axhline(h["sync_final_heldout"], color="k", ls="--", lw=1, label="sync's final held-out")
    a.set(xlabel="wall clock (s)", ylabel="held-out exact match (greedy)", title="held-out accuracy against time",
          ylim=(0.0, 1.0))  # an accuracy: few seeds' t-bands would stretch the axis past it
    a.legend(fontsize=7)
    ys = range(len(names))
    vals = [h["variants"][n]["time_to_sync_heldout_s"] for n in names]
    b.barh(list(ys), [v["mean"] or 0.0 for v in vals], xerr=[v["ci95"] or 0.0 for v in vals], color="tab:blue",
           alpha=0.7, capsize=3)
    for y, v in zip(ys, vals):
        if v["mean"] is None:  # no seed reached it: no bar, said so
            b.text(0, y, " not reached", va="center", fontsize=8, color="tab:red")
    b.set_yticks(list(ys), [f"{n} ({h['variants'][n]['reached_heldout']}/{h['variants'][n]['heldout_runs']})"
                            for n in names], fontsize=8)
    b.invert_yaxis()
    b.set(xlabel="seconds (mean ± 95%, seeds reaching)", title="time to sync's final held-out accuracy")
    b.set_xlim(left=0.0)
    return _save(plt, fig, out)


def plot_throughput(rows: list[dict], out: Path) -> Path:
    """Fig 5c: effective training throughput (trained tokens / wall clock) against eta, pinned and unpinned,
    decoupled objective with interruption; mean and 95% interval over seeds."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for pin in (True, False):
        rs = sorted([r for r in rows if r["pin"] == pin and r["interrupt"] == "abort"
                     and (r["eta"] == 0 or r["objective"] == "dec") and r["trained_tokens_per_s"]["mean"]],
                    key=lambda r: r["eta"])
        if not rs:
            continue
        xs = list(range(len(rs)))
        ax.errorbar([r["eta"] for r in rs], [r["trained_tokens_per_s"]["mean"] for r in rs],
                    yerr=[r["trained_tokens_per_s"]["ci95"] or 0.0 for r in rs], marker="o", capsize=3,
                    label="servers and trainer pinned apart" if pin else "unpinned (shared cores)")
        del xs
    ax.set_xscale("symlog", linthresh=1)
    ax.set(xlabel="max staleness eta (0 = synchronous)", ylabel="trained tokens / s",
           title="effective training throughput vs staleness")
    ax.legend(fontsize=8)
    return _save(plt, fig, out)


def plot_interrupt(rows: list[dict], out: Path) -> Path:
    """Fig 6b: generation throughput with interruptible generation (abort) and without (interrupt=none) at the
    same eta, decoupled objective, pinned; mean and 95% interval over seeds."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    etas = sorted({r["eta"] for r in rows if r["interrupt"] == "none"})
    width = 0.38
    for k, mode in enumerate(("abort", "none")):
        vals = [next((r for r in rows if r["eta"] == e and r["interrupt"] == mode and r["pin"]
                      and r["objective"] == "dec"), None) for e in etas]
        xs = [i + (k - 0.5) * width for i in range(len(etas))]
        ax.bar(xs, [v["gen_tokens_per_s"]["mean"] or 0 if v else 0 for v in vals], width,
               yerr=[(v["gen_tokens_per_s"]["ci95"] or 0) if v else 0 for v in vals], capsize=3,
               label="interruptible (abort)" if mode == "abort" else "non-interruptible (interrupt=none)")
    ax.set_xticks(range(len(etas)), [f"eta {e}" for e in etas])
    ax.set(ylabel="generated tokens / s", title="generation throughput: interruptible vs not")
    ax.legend(fontsize=8)
    return _save(plt, fig, out)


def write_outputs(runs: list[dict], out: Path, meta: dict) -> str:
    """table2.md, the four PNGs, runs.json (every raw result plus meta) and meta.json under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    rows = aggregate(runs)
    text = table2(rows, meta)
    (out / "runs.json").write_text(json.dumps({"meta": meta, "runs": runs}) + "\n")
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    sft = meta.get("sft_eval")
    task = {"longtail": "countdown task (long tail)", "longtail-sglang": "countdown task (long tail), real SGLang "
            "engine (CPU)"}.get(meta.get("sweep"), "addition task")
    order = sorted({r["name"] for r in runs}, key=lambda n: (variant_order().get(n, 10**6), n))
    hl = headline_table(headline(runs), order, meta.get("snapshots"))
    cpus = collections.Counter(r.get("cpu") or "not recorded" for r in runs)
    machines = "Runs by CPU: " + "; ".join(f"{c}: {n}" for c, n in cpus.items()) + ".\n\n"
    head = (f"# Table 2 ({task}): mean ± 95% Student-t half-width over seeds\n\n" + machines
            + (f"SFT start: held-out exact match greedy {sft['greedy']:.3f}, sampled (t=1) {sft['sampled_t1']:.3f} "
               f"over {sft['problems']} problems.\n\n" if sft else ""))
    (out / "table2.md").write_text(f"{head}{text}\n\n## Headline: time to sync's final reward, reward at equal wall "
                                   f"time, overlap bound\n\n{hl}\n\n"
                                   f"## Per step: train reward over the {TAIL} steps ending at each step, and the gap "
                                   f"to sync\n\n{per_step_table(runs)}\n\n"
                                   f"## Per run: the overlap bound from its seed's sync run and the fraction "
                                   f"achieved\n\n{per_run_table(per_run_bounds(runs))}\n\n"
                                   f"{json.dumps({k: v for k, v in meta.items() if k != 'sft_eval'})}\n")
    if any(r.get("diag") for r in runs):
        (out / "diagnostics.md").write_text(
            "What the objective saw (means over steps, then mean ± 95% interval over seeds); "
            "bench_paper.diagnostics.\n\n" + diagnostics_table(runs) + "\n")
    plot_curves(runs, "ppo", out / "fig5a.png", "naive PPO")
    plot_curves(runs, "dec", out / "fig5b.png", "decoupled PPO")
    plot_throughput(rows, out / "fig5c.png")
    plot_interrupt(rows, out / "fig6b.png")
    plot_headline(runs, order, out / "headline.png")
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", choices=sorted(SWEEPS), default="paper",
                    help="paper: the addition task (Table 2, the controls); longtail: the countdown task; "
                         "longtail-sglang: its headline on the real SGLang engine (sync vs the best eta, 3 seeds)")
    ap.add_argument("--config", "-c", default=None, help="the RL config (default: the sweep's)")
    ap.add_argument("--sft-config", default=None)
    ap.add_argument("--sft-dir", default=None, help="the SFT run (trained first if absent)")
    ap.add_argument("--variants", default=None, help="comma-separated names or globs (default: the sweep's; --list)")
    ap.add_argument("--list", action="store_true", help="print the variants and exit")
    ap.add_argument("--dry-run", action="store_true", help="print every run's command line and exit; nothing runs")
    ap.add_argument("--nointr-eta", type=int, default=None,
                    help="longtail: the eta of the interrupt=none and in_place runs (default: the best eta, decided once "
                         "from the results and kept in meta.json)")
    ap.add_argument("--seeds", default=None, help="comma-separated (default: the sweep's: 1-5, longtail-sglang 1-3)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--target", type=float, default=None, help="reward for time-to-target (3-step mean)")
    ap.add_argument("--out", default=None, help="the output directory (default: the sweep's; with --from-results, "
                                                "the results' own directory)")
    ap.add_argument("--runs-dir", default=None)
    ap.add_argument("--from-results", default=None, help="an output directory or runs.json: redraw, run nothing")
    ap.add_argument("--diagnose", action="store_true", help="with --from-results DIR: add the objective's diagnostics "
                                                            "to raw results from their runs under --runs-dir first")
    ap.add_argument("--snapshots", type=int, default=None,
                    help="export the weights every N steps and score them on the held-out split after each run "
                         f"(held-out accuracy against wall time; 0 = off; default: the long-tail sweeps {SNAPSHOT_EVERY}, "
                         "paper 0)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for one run")
    ap.add_argument("--until", default=None, help="start no run that would end after this time (HH:MM, local clock, "
                                                  "next occurrence) or this long from now (90m, 2h30m, 5400s); "
                                                  "the same command later continues")
    ap.add_argument("overrides", nargs="*", help="extra dotted overrides for every run")
    a = ap.parse_args(argv)
    if a.from_results and a.out is None:  # redrawn where the results are, never over the default sweep's tables
        src = Path(a.from_results)
        a.out = str(src.parent if src.suffix == ".json" else src)
    defaults = SWEEPS[a.sweep]
    for k in SWEEP_ARGS:
        if getattr(a, k) is None:
            setattr(a, k, defaults.get(k))
    a.seeds = a.seeds or "1,2,3,4,5"
    a.snapshots = a.snapshots or 0
    if a.snapshots < 0:
        raise SystemExit(f"bench_paper: --snapshots {a.snapshots}: pass N >= 1 steps between exports, or 0 for none")
    a.overrides = [*defaults.get("engine", []), *a.overrides]  # the engine first: the command line may override
    if a.variants is None and defaults.get("best_from") and not a.from_results:
        a.variants = real_engine_variants(ROOT / defaults["best_from"])
    out = Path(a.out)
    if a.from_results:
        if a.diagnose:
            print(f"diagnostics added to {backfill_diagnostics(Path(a.from_results), Path(a.runs_dir))} results")
        runs, meta = load_results(Path(a.from_results))
        if not runs:
            raise SystemExit(f"bench_paper: no results in {a.from_results}")
        print(write_outputs(runs, out, meta))
        return 0
    universe = sweep_variants(a.sweep)
    variants = pick(universe, a.variants)
    if a.list:
        print("\n".join(f"{v['name']}: eta {v['eta']}, {v['objective']}, interrupt {v['interrupt']}, "
                        f"pinned {v['pin']}, stale {v['stale']}, lr x{v['lr_scale']}, "
                        f"mini-batches {v['minibatches'] or 'config'}" for v in variants))
        return 0
    seeds = [int(x) for x in a.seeds.split(",")]
    nointr = a.sweep == "longtail" and a.variants == SWEEPS["longtail"]["variants"]  # the default longtail set
    if a.dry_run:
        runs_dir, sft_dir = Path(a.runs_dir).resolve(), Path(a.sft_dir)
        print(f"# sweep {a.sweep}: sft {a.sft_config} -> {sft_dir} (skipped when its final_hf/ exists); "
              f"{len(variants)} variants x {len(seeds)} seeds; results under {out}/raw")
        for seed in seeds:
            for v in variants:
                print(" ".join(train_command(v, seed, a, runs_dir, sft_dir)))
        if nointr:
            known = a.nointr_eta or load_results(out)[1].get("best_eta")
            later = "the best eta from the results, once the seeds' main runs are done"
            print(f"# and eta{{E}}-dec-nointr, eta{{E}}-dec-inplace for every seed, E = {known or later}")
        return 0
    deadline = until(a.until) if a.until else None
    backend = [o.split("=", 1)[1] for o in a.overrides if o.startswith("inference.backend=")]
    if backend and backend[-1] == "sglang":  # the real engine's environment, once, before any run (not per run)
        from mega_async.inference.sglang.cpu import engine_python

        try:
            engine_python()
        except FileNotFoundError as e:
            raise SystemExit(f"bench_paper: {e}") from None
    sft_dir, sft_eval = ensure_sft(a)
    fingerprint = sft_fingerprint(sft_dir)
    recorded = load_results(out)[1]
    check_same_start(recorded, sft_dir, sft_eval, fingerprint, out)
    # the eta of the interrupt=none runs and of their in_place pair (interruptible without resending: the servers keep
    # the interrupted requests' cache): decided once (the first sitting to finish its seeds' main runs), then kept
    # in meta.json, so every seed runs them at the same eta, within its seed, on its machine
    best = a.nointr_eta or recorded.get("best_eta")
    if nointr and best is not None:
        variants = variants + pick(universe, f"eta{best}-dec-nointr,eta{best}-dec-inplace")
    meta = {"sweep": a.sweep, "config": a.config, "steps": a.steps, "seeds": seeds, "target": a.target,
            "snapshots": a.snapshots,
            "overrides": a.overrides, "cpus": os.cpu_count(), "cpu": cpu_identity(), "load_before": os.getloadavg(), "sft_dir": str(sft_dir),
            "sft_eval": sft_eval, "sft_sha256": fingerprint, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _, failed, skipped = sweep(variants, seeds, out, lambda v, sd: run_one(v, sd, a, sft_dir), deadline)
    if nointr and best is None and skipped:  # the deadline came first: the interrupt=none runs are for later too
        skipped.append("eta{best}-dec-nointr and eta{best}-dec-inplace for every seed")
    elif nointr and best is None:  # interrupt=none at the eta that reached sync's final accuracy soonest (best_eta)
        best = best_eta(load_results(out)[0])
        if best is not None:
            extra = pick(universe, f"eta{best}-dec-nointr,eta{best}-dec-inplace")
            variants += extra
            _, more, skipped = sweep(extra, seeds, out, lambda v, sd: run_one(v, sd, a, sft_dir), deadline)
            failed += more
    if nointr and best is not None:
        meta["best_eta"] = best
    elif recorded.get("best_eta") is not None:
        meta["best_eta"] = recorded["best_eta"]
    runs, before = load_results(out)  # everything recorded so far, this sweep's and earlier ones
    if not runs:
        print(f"bench_paper: no run finished ({len(failed)} failed); nothing to draw", file=sys.stderr)
        return 1
    meta.update(load_after=os.getloadavg(), failed=failed, not_started=skipped, variants=[v["name"] for v in variants],
                finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    meta["sweeps"] = before.get("sweeps", []) + [{k: meta[k] for k in (
        "started", "finished", "variants", "seeds", "steps", "overrides", "load_before", "load_after", "failed",
        "not_started", "sft_sha256", "cpu")}]
    print(write_outputs(runs, out, meta))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
