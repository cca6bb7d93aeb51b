"""Memory soak of the driver: the tiny CPU run for many steps, the `mega-async train` process's RSS sampled every few
seconds against the step it is at, once with glibc's default malloc arenas and once with MALLOC_ARENA_MAX=2, side
by side (the same load on both). Reports RSS per step range and the growth per 100 steps after the warm-up, for
each, so a leak (growth that does not level off, in both) is told from allocator retention (growth only with many
arenas) and from noise.

    python tools/soak_memory.py --steps 400 --warmup 120 --out /tmp/soak
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def steps_done(metrics: Path) -> int:
    try:
        return sum(1 for _ in metrics.open())
    except OSError:
        return 0


def growth_per_100(samples: list[tuple[int, int]], warmup: int) -> float | None:
    """Least-squares slope of RSS (MiB) against step over the samples past `warmup`, per 100 steps."""
    pts = [(s, r / 1024) for s, r in samples if s >= warmup]
    if len(pts) < 3 or pts[-1][0] == pts[0][0]:
        return None
    n = len(pts)
    mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return 100 * sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=120, help="steps left out of the growth figure")
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("overrides", nargs="*", help="more dotted overrides for both runs")
    args = ap.parse_args(argv)
    if args.warmup >= args.steps:
        ap.error(f"--warmup {args.warmup} must be below --steps {args.steps}")
    out = Path(args.out)
    runs = {}
    for mode in ("default", "arena2"):
        env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
        if mode == "arena2":
            env["MALLOC_ARENA_MAX"] = "2"
        cmd = [sys.executable, "-m", "mega_async.cli", "train", "-c", args.config, f"logging.root_dir={out / mode}",
               f"trainer.total_steps={args.steps}", "trial_name=soak", "logging.tensorboard=false", *args.overrides]
        (out / mode).mkdir(parents=True, exist_ok=True)
        log = open(out / mode / "out.txt", "w")
        runs[mode] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), [])
    try:
        while any(p.poll() is None for p, _ in runs.values()):
            for mode, (p, samples) in runs.items():
                done = steps_done(next((out / mode).glob("*/soak/metrics.jsonl"), out / "none"))
                rss = rss_kib(p.pid)
                if rss is not None and 0 < done < args.steps:  # not the start-up, nor the final export
                    samples.append((done, rss))
            time.sleep(args.interval)
    finally:
        for p, _ in runs.values():
            if p.poll() is None:
                p.terminate()
    report = {}
    for mode, (p, samples) in runs.items():
        by = {}
        for s, r in samples:
            by.setdefault(s // 50 * 50, []).append(r / 1024)
        report[mode] = {"exit": p.returncode, "growth_mib_per_100_steps": growth_per_100(samples, args.warmup),
                        "rss_median_mib": {k: round(sorted(v)[len(v) // 2], 1) for k, v in sorted(by.items())}}
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    for mode, r in report.items():
        g = r["growth_mib_per_100_steps"]
        print(f"{mode}: exit {r['exit']}, RSS after step {args.warmup}: "
              f"{'n/a' if g is None else f'{g:+.2f}'} MiB per 100 steps; medians per 50 steps {r['rss_median_mib']}")
    return 0 if all(r["exit"] == 0 for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
