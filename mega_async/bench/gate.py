"""The benchmark's regression gate: a result against a baseline, figure by figure, noise-aware.

A figure regresses when its median moved the wrong way by more than its tolerance:
    tolerance = min(max_tolerance, max(threshold, noise_k x max(relative spread of baseline, of result)))
(relative spread = half the min..max range over the repeats, over the median), so a noisy machine widens
the gate only as far as the repeats show noise, and never past `max_tolerance`. A figure the baseline has
and the result lost is a regression too. Also: the history file (one line per run) and its plot.
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

from mega_async.utils.diskspace import append_line, read_jsonl

SCHEMA = 1
ROOT = Path(__file__).resolve().parents[2]
BASELINE_DIR = ROOT / "benchmarks" / "baselines"


class GateError(ValueError):
    """An unreadable or incompatible result/baseline file."""


def stat(values: Sequence[Optional[float]]) -> dict[str, Any]:
    """Median, relative spread and raw values of one figure over repeats (None values counted as missing)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"median": None, "spread": None, "values": [], "missing": len(values)}
    med = statistics.median(vals)
    spread = (max(vals) - min(vals)) / 2 / abs(med) if med else 0.0
    return {"median": med, "spread": spread, "values": vals, "missing": len(values) - len(vals)}


def load_json(path: str | Path, what: str) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what} file {p} does not exist")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise GateError(f"{what} file {p} is not JSON ({e})") from None
    if data.get("schema") != SCHEMA or not isinstance(data.get("scenarios"), dict):
        raise GateError(f"{what} file {p} is not a mega-async bench result (schema {SCHEMA} with scenarios); "
                        "write one with mega-async bench --update-baseline")
    return data


def save_json(data: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    tmp.replace(p)  # never a half-written baseline
    return p


def default_baseline(result: dict[str, Any]) -> Path:
    """benchmarks/baselines/gpu.json on a GPU machine, cpu.json otherwise."""
    return BASELINE_DIR / ("gpu.json" if result.get("machine", {}).get("gpu") else "cpu.json")


PROVENANCE = ("created", "machine", "versions", "git")


def merge_baseline(old: dict[str, Any], result: dict[str, Any]) -> dict[str, dict]:
    """The scenarios of a refreshed baseline: the result's, each stamped with where and when it was measured
    (`measured`: created, machine, versions, git), beside the old baseline's others, which keep their own stamp
    (or the old file's top-level one, written before scenarios carried theirs): the file's top level then describes
    the latest refresh, never a scenario measured elsewhere."""
    stamp = lambda doc: {k: doc[k] for k in PROVENANCE if k in doc}  # noqa: E731
    kept = {name: {**scn, "measured": scn.get("measured") or stamp(old)}
            for name, scn in old.get("scenarios", {}).items() if name not in result["scenarios"]}
    return {**kept, **{name: {**scn, "measured": stamp(result)} for name, scn in result["scenarios"].items()}}


def _judge(fig: str, rule: dict[str, Any], cur: dict, base: Optional[dict], noise_k: float) -> dict[str, Any]:
    v: dict[str, Any] = {"figure": fig, "current": cur.get("median"), "cur_spread": cur.get("spread"),
                         "baseline": None, "change": None, "tolerance": None, "verdict": "info"}
    if not rule:
        v["baseline"] = base.get("median") if base else None
        return v
    if base is None or base.get("median") is None:
        v["verdict"] = "new"
        return v
    b, c = base["median"], cur.get("median")
    v["baseline"] = b
    if c is None:
        v["verdict"] = "REGRESSED"  # the baseline had it, this run lost it
        return v
    denom = max(abs(b), float(rule.get("floor", 1e-12)))
    change = (c - b) / denom
    worse = -change if rule["better"] == "higher" else change
    noise = max(base.get("spread") or 0.0, cur.get("spread") or 0.0)
    tol = min(float(rule.get("max_tolerance", 1.0)), max(float(rule["threshold"]), noise_k * noise))
    v.update(change=change, tolerance=tol,
             verdict="REGRESSED" if worse > tol else ("improved" if -worse > tol else "ok"))
    return v


def compare(result: dict[str, Any], baseline: Optional[dict[str, Any]], noise_k: float = 2.0) -> list[dict]:
    """One verdict per (scenario, figure) of the result: REGRESSED, ok, improved, new (no baseline) or info."""
    out = []
    for name, scn in result["scenarios"].items():
        base_scn = (baseline or {}).get("scenarios", {}).get(name)
        rules = scn.get("rules", {})
        figs = list(scn["figures"]) + [f for f in rules if f not in scn["figures"]]
        for fig in figs:
            cur = scn["figures"].get(fig, {"median": None})
            base = base_scn["figures"].get(fig) if base_scn else None
            out.append({"scenario": name, **_judge(fig, rules.get(fig, {}), cur, base, noise_k)})
    return out


def _num(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def table(verdicts: list[dict], result: dict[str, Any], baseline_path: Optional[Path]) -> str:
    """The printed comparison: every figure, gated ones with baseline, change, tolerance and verdict."""
    git = result.get("git", {})
    lines = [f"mega-async bench  commit {str(git.get('commit'))[:12]}{' (dirty)' if git.get('dirty') else ''}  "
             f"cpus {result['machine'].get('cpus')}  gpu {result['machine'].get('gpu') or '-'}  "
             f"load {result['machine'].get('load_avg')}  baseline {baseline_path or '(none)'}",
             f"{'scenario':<16} {'figure':<26} {'baseline':>10} {'current':>10} {'spread':>7} {'change':>8} "
             f"{'tol':>6}  verdict"]
    for v in verdicts:
        ch = f"{100 * v['change']:+.1f}%" if v["change"] is not None else "-"
        tol = f"{100 * v['tolerance']:.0f}%" if v["tolerance"] is not None else "-"
        sp = f"{100 * v['cur_spread']:.0f}%" if v.get("cur_spread") is not None else "-"
        lines.append(f"{v['scenario']:<16} {v['figure']:<26} {_num(v['baseline']):>10} {_num(v['current']):>10} "
                     f"{sp:>7} {ch:>8} {tol:>6}  {v['verdict']}")
    for name, scn in result["scenarios"].items():
        if scn.get("staleness_hist"):
            hist = ", ".join(f"{k}: {n}" for k, n in sorted(scn["staleness_hist"].items(), key=lambda kv: int(kv[0])))
            lines.append(f"{name:<16} staleness histogram (versions: groups over all repeats)  {hist}")
    return "\n".join(lines)


def append_history(result: dict[str, Any], history_dir: Path) -> Path:
    """One line per run in history.jsonl (medians); history.png redrawn from all lines."""
    history_dir.mkdir(parents=True, exist_ok=True)
    line = {"created": result["created"], "commit": result.get("git", {}).get("commit"),
            "load_avg": result["machine"].get("load_avg"),
            "scenarios": {n: {f: s["median"] for f, s in scn["figures"].items()} for n, scn in result["scenarios"].items()},
            "gated": sorted({f for scn in result["scenarios"].values() for f in scn.get("rules", {})})}
    path = history_dir / "history.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:  # whole or not at all (a full disk names the file and leaves no torn line); a torn last line is skipped
        append_line(fd, (json.dumps(line) + "\n").encode(), path)
    finally:
        os.close(fd)
    return plot_history(read_jsonl(path), history_dir / "history.png")


def plot_history(rows: list[dict[str, Any]], out: Path) -> Path:
    """One panel per gated figure, one line per scenario, x = run (date and commit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = sorted({f for r in rows for f in r.get("gated", [])}) or ["wall_s"]
    cols = min(3, len(figs))
    nrows = -(-len(figs) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.2 * nrows), squeeze=False)
    labels = [f"{r['created'][5:10]} {str(r.get('commit'))[:7]}" for r in rows]
    for ax, name in zip(axes.flat, figs):
        scns = sorted({s for r in rows for s, v in r["scenarios"].items() if v.get(name) is not None})
        for s in scns:
            ys = [r["scenarios"].get(s, {}).get(name) for r in rows]
            ax.plot(range(len(rows)), [float("nan") if y is None else y for y in ys], marker="o", label=s)
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(len(rows)), labels, rotation=45, fontsize=6, ha="right")
        if scns:
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(figs):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
