"""The AReaL paper's async-vs-sync table at tiny scale: synchronous (max_staleness=0) against asynchronous
runs at eta 1, 2, 4, 8, with the decoupled objective on (prox_logp from the config, e.g. loglinear) and
off (prox_logp=behavior, standard PPO), over several seeds. One command runs them all one after another
and writes the table (markdown), the raw per-run figures (JSON) and the plot (PNG):

    python tools/bench_async.py --seeds 1,2,3 --out benchmarks/async
    python tools/bench_async.py --from-results benchmarks/async/runs.json   # table + plot again, no runs

Figures per run (mega_async.run.report.summarize): wall clock to the same number of consumed groups
(trainer.total_steps x B), time to reward 0.8, final reward (mean of the last 3 steps), realized staleness.
Per variant: median and spread (min..max) over seeds; speed-up = sync's median over the variant's median.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mega_async.run.report import read_metrics, summarize  # noqa: E402

DEFAULT_VARIANTS = "sync:0,eta1:1,eta2:2,eta4:4,eta8:8,eta2-ppo:2:behavior,eta8-ppo:8:behavior"
FIGURES = ("wall_s", "time_to_reward_s", "reward_final", "token_staleness_mean", "staleness_mean",
           "gen_groups_per_s")


def parse_variants(spec: str) -> list[dict[str, Any]]:
    """'name:eta[:prox_logp],...' -> [{'name', 'eta', 'prox_logp' (None = the config's)}]."""
    out = []
    for part in spec.split(","):
        bits = part.strip().split(":")
        if len(bits) not in (2, 3) or not bits[1].isdigit():
            raise SystemExit(f"bench_async: bad variant {part!r}: write name:eta or name:eta:prox_logp, e.g. eta4:4:behavior")
        out.append({"name": bits[0], "eta": int(bits[1]), "prox_logp": bits[2] if len(bits) == 3 else None})
    if len({v["name"] for v in out}) != len(out):
        raise SystemExit(f"bench_async: variant names repeat in {spec!r}")
    return out


def run_one(config: str, variant: dict, seed: int, steps: int, runs_dir: Path, extra: Sequence[str],
            timeout: float) -> dict[str, Any]:
    """One `mega-async train` in a subprocess; returns its summary plus the reward curve."""
    trial = f"{variant['name']}_s{seed}"
    ov = [f"rollout.max_staleness={variant['eta']}", f"seed={seed}", f"trainer.total_steps={steps}",
          f"logging.root_dir={runs_dir}", "experiment_name=bench_async", f"trial_name={trial}",
          "logging.tensorboard=false", *extra]
    if variant["prox_logp"]:
        ov.append(f"algorithm.prox_logp={variant['prox_logp']}")
    cmd = [sys.executable, "-m", "mega_async.cli", "train", "-c", config, *ov]
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"run {trial} failed (exit {r.returncode}): {tail}")
    history = read_metrics(runs_dir / "bench_async" / trial)
    return {"variant": variant["name"], "eta": variant["eta"], "prox_logp": variant["prox_logp"], "seed": seed,
            "process_s": round(time.monotonic() - t0, 2), **summarize(history),
            "curve": [(h["elapsed_s"], h["reward_mean"]) for h in history]}


def _med(vals: list) -> Optional[float]:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and min..max per variant and figure; speed-ups against the `eta == 0` variant."""
    names = list(dict.fromkeys(r["variant"] for r in runs))
    rows = []
    for name in names:
        rs = [r for r in runs if r["variant"] == name]
        row: dict[str, Any] = {"variant": name, "eta": rs[0]["eta"], "prox_logp": rs[0]["prox_logp"] or "config",
                               "seeds": len(rs)}
        for f in FIGURES:
            vals = [r.get(f) for r in rs if r.get(f) is not None]
            row[f] = _med(vals)
            row[f + "_spread"] = (min(vals), max(vals)) if vals else None
            row[f + "_missing"] = len(rs) - len(vals)
        rows.append(row)
    sync = next((r for r in rows if r["eta"] == 0), None)
    for row in rows:
        for f, key in (("wall_s", "speedup"), ("time_to_reward_s", "speedup_to_reward")):
            ok = sync is not None and sync[f] and row[f]
            row[key] = sync[f] / row[f] if ok else None
        row["reward_gap_vs_sync"] = (row["reward_final"] - sync["reward_final"]
                                     if sync is not None and row["reward_final"] is not None
                                     and sync["reward_final"] is not None else None)
    return rows


def _cell(row: dict, f: str, fmt: str = "{:.3g}") -> str:
    if row[f] is None:
        return "never" if row.get(f + "_missing") else "-"
    lo, hi = row[f + "_spread"]
    miss = f" ({row[f + '_missing']} never)" if row.get(f + "_missing") else ""
    return f"{fmt.format(row[f])} [{fmt.format(lo)}..{fmt.format(hi)}]{miss}"


def table(rows: list[dict[str, Any]], threshold: float = 0.8) -> str:
    """Markdown table: median [min..max] over seeds."""
    head = ["variant", "eta", "prox_logp", "seeds", "wall clock s", "speed-up", f"time to reward {threshold} s",
            "speed-up to reward", "final reward", "vs sync", "token staleness", "groups/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        sp = lambda v: f"{v:.2f}x" if v is not None else "-"  # noqa: E731
        gap = f"{r['reward_gap_vs_sync']:+.3f}" if r["reward_gap_vs_sync"] is not None else "-"
        lines.append("| " + " | ".join([
            r["variant"], str(r["eta"]), r["prox_logp"], str(r["seeds"]), _cell(r, "wall_s"), sp(r["speedup"]),
            _cell(r, "time_to_reward_s"), sp(r["speedup_to_reward"]), _cell(r, "reward_final"), gap,
            _cell(r, "token_staleness_mean"), _cell(r, "gen_groups_per_s")]) + " |")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], rows: list[dict[str, Any]], out: Path) -> Path:
    """Reward against wall clock (every seed, one colour per variant) and the median wall clock per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, row in enumerate(rows):
        c = colours[i % len(colours)]
        for j, r in enumerate(x for x in runs if x["variant"] == row["variant"]):
            t, rew = zip(*r["curve"]) if r["curve"] else ((), ())
            a.plot(t, rew, color=c, alpha=0.7, lw=1, label=row["variant"] if j == 0 else None)
        lo, hi = row["wall_s_spread"]
        b.bar(i, row["wall_s"], color=c, yerr=[[row["wall_s"] - lo], [hi - row["wall_s"]]], capsize=3)
    a.set(xlabel="wall clock (s)", ylabel="reward", title="reward vs wall clock (all seeds)")
    a.legend(fontsize=8)
    b.set_xticks(range(len(rows)), [r["variant"] for r in rows], rotation=30)
    b.set(ylabel="wall clock to the same consumed groups (s)", title="median [min..max] over seeds")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def write_outputs(runs: list[dict], out_dir: Path, meta: dict) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = aggregate(runs)
    text = table(rows)
    (out_dir / "runs.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
    (out_dir / "table.md").write_text(f"{text}\n\n{json.dumps(meta)}\n")
    plot(runs, rows, out_dir / "plot.png")
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", "-c", default="configs/tiny_cpu.yaml")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="name:eta[:prox_logp],... (eta 0 = synchronous)")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/async", help="table.md, runs.json and plot.png go here")
    ap.add_argument("--runs-dir", default="runs/bench_async_runs", help="root of the runs' directories")
    ap.add_argument("--from-results", default=None, help="rebuild table and plot from a runs.json, run nothing")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds for one run")
    ap.add_argument("overrides", nargs="*", help="extra dotted overrides for every run")
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.from_results:
        saved = json.loads(Path(a.from_results).read_text())
        print(write_outputs(saved["runs"], out, saved["meta"]))
        return 0
    variants, seeds = parse_variants(a.variants), [int(s) for s in a.seeds.split(",")]
    meta = {"config": a.config, "steps": a.steps, "seeds": seeds, "overrides": a.overrides,
            "load_before": os.getloadavg(), "cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                             time.gmtime())}
    runs = []
    for seed in seeds:  # seeds outermost: a drift in machine load hits every variant alike
        for v in variants:
            r = run_one(a.config, v, seed, a.steps, Path(a.runs_dir).resolve(), a.overrides, a.timeout)
            print(f"{v['name']} seed {seed}: wall {r['wall_s']:.1f}s, final reward {r['reward_final']:.3f}, "
                  f"time to 0.8 {r['time_to_reward_s']}", flush=True)
            runs.append(r)
    meta["load_after"] = os.getloadavg()
    print(write_outputs(runs, out, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
