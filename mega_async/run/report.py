"""End-of-run report: summary figures from a run's per-step metrics, a printed table, and a PNG of reward,
throughput, staleness and the step-time split written next to `metrics.jsonl`.

The figures here are also what the nightly benchmark (mega_async/bench/scenarios.py) and tools/bench_async.py gate
and tabulate, so a run, a benchmark and the paper table all read the same numbers the same way.
"""
from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

from mega_async.utils.diskspace import read_jsonl, replaced

logger = logging.getLogger("mega_async.run.report")

# executor counters of every finished group (kept, filtered, rejected or failed): generation throughput
GENERATED_KEYS = ("executor/accepted", "executor/filtered", "executor/rejected", "executor/failed")
STALENESS_PREFIX = "executor/consumed_staleness_"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl (a run directory or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist: pass a run directory that holds metrics.jsonl")
    return read_jsonl(p)  # a torn last line (a kill mid-write) is skipped


def _col(history: Sequence[dict], key: str) -> list[float]:
    return [float(h[key]) for h in history if isinstance(h.get(key), (int, float))]


def _generated(h: dict) -> float:
    return float(sum(h.get(k, 0) for k in GENERATED_KEYS))


def _rate(history: Sequence[dict], value: Any) -> Optional[float]:
    """Steady-state rate of a cumulative counter: its growth from the first step to the last over elapsed time
    (the first step's warm-up is left out when there are at least two steps)."""
    if len(history) >= 2:
        a, b = history[0], history[-1]
        dt = b["elapsed_s"] - a["elapsed_s"]
        return (value(b) - value(a)) / dt if dt > 0 else None
    if history and history[0].get("elapsed_s"):
        return value(history[0]) / history[0]["elapsed_s"]
    return None


def segments(history: Sequence[dict]) -> list[list[dict]]:
    """A resumed run appends to the same metrics.jsonl with its clock restarted: one list per process."""
    out: list[list[dict]] = []
    for h in history:
        if not out or h.get("elapsed_s", 0.0) < out[-1][-1].get("elapsed_s", 0.0):
            out.append([])
        out[-1].append(h)
    return out


def staleness_histogram(history: Sequence[dict]) -> dict[int, int]:
    """Realized staleness of the consumed groups: version at consumption minus admission version -> count
    (the executor's counters restart with a resumed process: summed over processes)."""
    out: dict[int, int] = {}
    for seg in segments(history):
        for k, v in seg[-1].items():
            if k.startswith(STALENESS_PREFIX):
                out[int(k[len(STALENESS_PREFIX):])] = out.get(int(k[len(STALENESS_PREFIX):]), 0) + int(v)
    return dict(sorted(out.items()))


def time_to_reward(history: Sequence[dict], threshold: float, key: str = "reward_mean") -> Optional[float]:
    """Elapsed seconds at the first step whose reward reaches `threshold` (None if it never does)."""
    for h in history:
        if h.get(key) is not None and h[key] >= threshold:
            return float(h["elapsed_s"])
    return None


def summarize(history: Sequence[dict], reward_threshold: float = 0.8, tail: int = 3) -> dict[str, Any]:
    """The figures of one run (None where the metrics do not carry what a figure needs)."""
    if not history:
        raise ValueError("no steps in the metrics: nothing to summarize")
    rewards = _col(history, "reward_mean")
    step_s, wait, train, sync = (sum(_col(history, k)) for k in ("step_s", "rollout_wait_s", "train_s",
                                                                   "sync/push_s"))
    train_tokens = sum(_col(history, "train/tokens"))
    sync_bytes, sync_total = _col(history, "sync/bytes"), _col(history, "sync/total_s")
    hist = staleness_histogram(history)
    n_hist = sum(hist.values())
    segs = segments(history)
    last = segs[-1]  # rates from the latest process (counters restart with it)
    out: dict[str, Any] = {
        "steps": len(history),
        "wall_s": float(sum(seg[-1]["elapsed_s"] for seg in segs)),
        "resumes": len(segs) - 1,
        "reward_first": rewards[0] if rewards else None,
        "reward_final": statistics.fmean(rewards[-tail:]) if rewards else None,
        "time_to_reward_s": time_to_reward(history, reward_threshold),
        "reward_threshold": reward_threshold,
        "gen_groups_per_s": _rate(last, _generated),
        "gen_tokens_per_s": (_rate(last, lambda h: h["executor/output_tokens"])
                             if "executor/output_tokens" in history[-1] else None),
        "train_tokens_per_s": train_tokens / train if train > 0 and train_tokens else None,
        "sync_s": statistics.median(_col(history, "sync/push_s")) if _col(history, "sync/push_s") else None,
        "sync_bytes_per_s": (statistics.median(b / t for b, t in zip(sync_bytes, sync_total) if t > 0)
                             if sync_bytes and sync_total else None),
        "token_staleness_mean": statistics.fmean(_col(history, "train/staleness")) if _col(history, "train/staleness")
        else None,
        "staleness_hist": hist,
        "staleness_mean": sum(k * v for k, v in hist.items()) / n_hist if n_hist else None,
        "staleness_max": max(hist) if hist else None,
    }
    out.update(generation_spread(history))
    if step_s > 0:
        other = max(0.0, step_s - wait - train - sync)  # timings are rounded: parts may pass step_s a little
        total = wait + train + sync + other
        out["split"] = {k: v / total for k, v in
                        (("rollout_wait", wait), ("train", train), ("sync", sync), ("other", other))}
    return out


def generation_spread(history: Sequence[dict]) -> dict[str, float]:
    """Generation lengths and their long tail over a run (means over steps of the batch/* statistics; empty for
    metrics without them): output tokens per sequence (mean, max) and, per batch, the longest sequence's tokens
    and generation seconds over the batch's median."""
    out = {}
    for key, name in (("batch/gen_len_mean", "gen_len_mean"), ("batch/gen_len_max", "gen_len_max"),
                      ("batch/gen_len_max_over_median", "gen_len_max_over_median"),
                      ("batch/gen_s_max_over_median", "gen_s_max_over_median")):
        vals = _col(history, key)
        if vals:
            out[name] = statistics.fmean(vals)
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def summary_table(s: dict[str, Any]) -> str:
    """Plain-text table of a run's figures (printed at the end of `mega-async train`)."""
    rows = [("steps", s["steps"]), ("wall clock (s)", s["wall_s"]),
            ("reward first -> final", f"{_fmt(s['reward_first'])} -> {_fmt(s['reward_final'])}"),
            (f"time to reward {s['reward_threshold']} (s)", s["time_to_reward_s"]),
            ("generation (groups/s)", s["gen_groups_per_s"]), ("generation (tokens/s)", s["gen_tokens_per_s"]),
            ("trainer (tokens/s)", s["train_tokens_per_s"]), ("weight sync (s, median)", s["sync_s"]),
            ("weight sync (MB/s, median)", s["sync_bytes_per_s"] / 1e6 if s["sync_bytes_per_s"] else None),
            ("staleness mean / max (groups)", f"{_fmt(s['staleness_mean'])} / {_fmt(s['staleness_max'])}"),
            ("token staleness (mean)", s["token_staleness_mean"])]
    if "gen_len_mean" in s:
        rows.append(("generated tokens / seq: mean, batch max", f"{_fmt(s['gen_len_mean'])}, {_fmt(s['gen_len_max'])}"))
        rows.append(("slowest / median sample: tokens, seconds", f"{_fmt(s['gen_len_max_over_median'])}, "
                                                                  f"{_fmt(s.get('gen_s_max_over_median'))}"))
    if "split" in s:
        rows.append(("step time split", "  ".join(f"{k} {100 * v:.0f}%" for k, v in s["split"].items())))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {_fmt(v)}" for k, v in rows)


def plot_run(history: Sequence[dict], out: str | Path, title: str = "") -> Path:
    """Four panels (reward, throughput, staleness, step-time split) as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    ax[0, 0].plot(steps, [h.get("reward_mean") for h in history], marker=".", label="reward (all groups)")
    if "batch_reward_mean" in history[0]:
        ax[0, 0].plot(steps, [h.get("batch_reward_mean") for h in history], marker=".", label="trained batch")
    ax[0, 0].set(title="reward", xlabel="step")
    ax[0, 0].legend(fontsize=8)
    prev = [None] + list(history[:-1])
    dt = [h["elapsed_s"] - (p["elapsed_s"] if p else 0.0) for h, p in zip(history, prev)]
    gen = [(_generated(h) - (_generated(p) if p else 0.0)) / d if d > 0 else 0.0 for h, p, d in zip(history, prev, dt)]
    ax[0, 1].plot(steps, gen, marker=".", label="generated groups/s")
    trn = [h.get("train/tokens", 0) / h["train_s"] / 1000 if h.get("train_s") else 0.0 for h in history]
    ax[0, 1].plot(steps, trn, marker=".", label="trainer k tokens/s")
    ax[0, 1].set(title="throughput", xlabel="step")
    ax[0, 1].legend(fontsize=8)
    ax[1, 0].plot(steps, [h.get("train/staleness", 0.0) for h in history], marker=".", label="token staleness (mean)")
    hist = staleness_histogram(history)
    if hist:
        tw = ax[1, 0].inset_axes([0.6, 0.55, 0.37, 0.4])
        tw.bar(list(hist), list(hist.values()))
        tw.set_title("groups by staleness", fontsize=7)
        tw.tick_params(labelsize=6)
    ax[1, 0].set(title="staleness (versions)", xlabel="step")
    ax[1, 0].legend(fontsize=8, loc="upper left")
    bottom = [0.0] * len(history)
    for key, label in (("rollout_wait_s", "rollout wait"), ("train_s", "train"), ("sync/push_s", "sync")):
        vals = [float(h.get(key, 0.0)) for h in history]
        ax[1, 1].bar(steps, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    other = [max(0.0, float(h.get("step_s", 0.0)) - b) for h, b in zip(history, bottom)]
    ax[1, 1].bar(steps, other, bottom=bottom, label="other")
    ax[1, 1].set(title="step time (s)", xlabel="step")
    ax[1, 1].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=90, format="png")
    plt.close(fig)
    return out


def write_report(run_dir: str | Path, reward_threshold: float = 0.8) -> tuple[Path, str]:
    """report.png next to metrics.jsonl and the summary table; returns (png path, table text)."""
    run_dir = Path(run_dir)
    history = read_metrics(run_dir)
    s = summarize(history, reward_threshold)
    with replaced(run_dir / "summary.json") as tmp:  # whole or not at all, never half of one a reader opens
        tmp.write_text(json.dumps(s, indent=1) + "\n")
    with replaced(run_dir / "report.png") as tmp:
        plot_run(history, tmp, title=str(run_dir))
    png = run_dir / "report.png"
    from mega_async.utils.events import draw_run_timeline

    draw_run_timeline(run_dir)  # timeline.png from events.jsonl: rollout and training lanes, weight syncs
    return png, summary_table(s)
