"""`mega-async bench`: the nightly throughput benchmark over fixed scenarios (configs/bench/*.yaml).

Per scenario and repeat: a real `mega-async train` run in a subprocess (generation, trainer and weight-sync
throughput, the step-time split, realized staleness, peak memory of the process tree) and/or the executor's
overhead against a bare asyncio.gather measured in the same process. Medians over repeats go into one JSON
result with the machine, versions and git commit; mega_async.bench.gate compares it with a baseline,
prints the table, appends the history and draws its plot. Exit status 1 when a figure regressed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from mega_async.bench import gate as bench_gate
from mega_async.utils.lifeline import child_preexec

logger = logging.getLogger("mega_async.bench.scenarios")

ROOT = Path(__file__).resolve().parents[2]
SCENARIO_DIR = ROOT / "configs" / "bench"
TRAIN_FIGURES = ("gen_groups_per_s", "gen_tokens_per_s", "train_tokens_per_s", "sync_s", "sync_bytes_per_s",
                 "staleness_mean", "token_staleness_mean", "wall_s")
SPLIT_FIGURES = ("rollout_wait", "train", "sync", "other")
GEN_FIGURES = ("gen_len_mean", "gen_len_max", "gen_len_max_over_median", "gen_s_max_over_median")


class BenchError(ValueError):
    """A bad scenario file or argument (one line, naming the key and the fix)."""


@dataclass
class Scenario:
    name: str
    description: str = ""
    repeats: int = 3
    train: Optional[dict[str, Any]] = None  # {config, overrides}
    sft: Optional[dict[str, Any]] = None  # {config, overrides}: a `mega-async sft` run first, its model trained on
    accuracy: Optional[dict[str, Any]] = None  # {target, window}: accuracy figures from the run's reward
    executor: Optional[dict[str, Any]] = None  # {trajectories, batch, eta}
    serve: Optional[dict[str, Any]] = None  # {config, model, batch, new_tokens}: mega_async.bench.serving
    device: str = "any"  # gpu: runs only where a GPU is visible (left out of a CPU machine's nightly run)
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {better, threshold, max_tolerance}
    path: str = ""


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate one scenario YAML."""
    p = Path(path)
    raw = yaml.safe_load(p.read_text()) or {}
    known = {"name", "description", "repeats", "train", "executor", "figures", "sft", "accuracy", "serve", "device"}
    unknown = set(raw) - known
    if unknown:
        raise BenchError(f"{p}: unknown key(s) {sorted(unknown)}; a scenario has {sorted(known)}")
    s = Scenario(name=raw.get("name") or p.stem, description=raw.get("description", ""),
                 repeats=raw.get("repeats", 3), train=raw.get("train"), executor=raw.get("executor"),
                 figures=raw.get("figures") or {}, sft=raw.get("sft"), accuracy=raw.get("accuracy"),
                 serve=raw.get("serve"), device=raw.get("device", "any"), path=str(p))
    if not isinstance(s.repeats, int) or s.repeats < 1:
        raise BenchError(f"{p}: repeats={s.repeats!r} must be a positive integer")
    if s.train is None and s.executor is None and s.serve is None:
        raise BenchError(f"{p}: a scenario needs a train:, an executor: and/or a serve: section")
    if s.device not in ("any", "gpu"):
        raise BenchError(f"{p}: device={s.device!r}: use any (the default) or gpu")
    if s.serve is not None:
        from mega_async.bench.serving import SIZES

        bad = set(s.serve) - {"config", "model", "batch", "new_tokens"}
        if bad or "config" not in s.serve or s.serve.get("model", "tiny") not in SIZES:
            raise BenchError(f"{p}: serve: takes config (a run YAML), model (one of {sorted(SIZES)}), batch and "
                             f"new_tokens, got {s.serve!r}")
    if s.train is not None:
        bad = set(s.train) - {"config", "overrides"}
        if bad or "config" not in s.train:
            raise BenchError(f"{p}: train: takes config (a run YAML) and overrides (a list), got {sorted(s.train)}")
    _check_task_sections(s, p)
    if s.executor is not None:
        bad = set(s.executor) - {"trajectories", "batch", "eta", "rounds"}
        if bad:
            raise BenchError(f"{p}: executor: takes trajectories, batch, eta and rounds, not {sorted(bad)}")
    for fig, rule in s.figures.items():
        if not isinstance(rule, dict) or rule.get("better") not in ("higher", "lower") \
                or not isinstance(rule.get("threshold"), (int, float)) or rule["threshold"] < 0:
            raise BenchError(f"{p}: figures.{fig} needs better: higher|lower and threshold: a relative change >= 0 "
                             f"(e.g. 0.3), got {rule!r}")
    return s


def _check_task_sections(s: Scenario, p: Path) -> None:
    if s.sft is not None:
        if s.train is None or not isinstance(s.sft, dict) or set(s.sft) - {"config", "overrides"} \
                or "config" not in s.sft:
            raise BenchError(f"{p}: sft: takes config (an SFT YAML) and overrides (a list) and needs a train: section "
                             f"that trains from its model, got {s.sft!r}")
    if s.accuracy is not None:
        a = s.accuracy
        if s.train is None or not isinstance(a, dict) or set(a) - {"target", "window"} \
                or not isinstance(a.get("target"), (int, float)) or not isinstance(a.get("window", 3), int) \
                or a.get("window", 3) < 1:
            raise BenchError(f"{p}: accuracy: takes target (a reward, e.g. 0.5) and window (steps >= 1, default 3) "
                             f"and needs a train: section, got {a!r}")


def gpu_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no usable torch: no GPU either
        return False


def find_scenarios(names: Sequence[str] = ()) -> list[Scenario]:
    """Scenarios by name or path; all of configs/bench/ when none are named (on a machine without a GPU, all but
    the `device: gpu` ones; naming one there is an error)."""
    if not names:
        found = [load_scenario(p) for p in sorted(SCENARIO_DIR.glob("*.yaml"))]
        return [s for s in found if s.device != "gpu"] if not gpu_visible() else found
    out = []
    for n in names:
        p = Path(n) if n.endswith((".yaml", ".yml")) else SCENARIO_DIR / f"{n}.yaml"
        if not p.exists():
            have = ", ".join(sorted(x.stem for x in SCENARIO_DIR.glob("*.yaml")))
            raise BenchError(f"no scenario {n!r} ({p} does not exist); scenarios: {have}")
        s = load_scenario(p)
        if s.device == "gpu" and not gpu_visible():
            raise BenchError(f"scenario {s.name} needs a GPU and none is visible here; on CPU, "
                             "tools/bench_gpu.py server-gen --cpu-dry-run runs its code on the tiny model")
        out.append(s)
    return out


# ---- measurements ----------------------------------------------------------------------------------
class PeakRSS:
    """Peak resident memory of a process and its descendants (summed), sampled on a thread."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            total = 0
            try:
                for p in [root, *root.children(recursive=True)]:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
            except psutil.Error:
                return
            self.peak = max(self.peak, total)
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakRSS":
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()


def accuracy_figures(history: Sequence[dict], target: float, window: int = 3) -> dict[str, Optional[float]]:
    """A task's learning figures from the per-step reward (exact match for the addition task): the mean over the
    last `window` steps (the accuracy at the run's final step) and the elapsed seconds at the first step whose
    `window`-step mean reaches `target` (None: never, which the gate counts as a lost figure)."""
    pts = [(float(h["elapsed_s"]), float(h["reward_mean"])) for h in history
           if isinstance(h.get("reward_mean"), (int, float))]
    means = [(pts[i][0], statistics.fmean(r for _, r in pts[i - window + 1:i + 1])) for i in range(window - 1, len(pts))]
    return {"accuracy_at_step": means[-1][1] if means else None,
            "time_to_accuracy_s": next((t for t, m in means if m >= target), None)}


def prepare_sft(sft: dict[str, Any], cache_root: Path, timeout: float = 3600.0) -> Path:
    """The SFT run a scenario trains from: `mega-async sft` once per config and overrides (cached under
    `cache_root/<hash>`: repeats and later nights reuse it); returns its run directory."""
    import hashlib
    import shutil

    cfg = Path(sft["config"])
    ov = [str(o) for o in sft.get("overrides", [])]
    key = hashlib.sha256((cfg.read_text() if cfg.exists() else str(cfg)).encode() + repr(ov).encode()).hexdigest()[:12]
    run = cache_root / "bench_sft" / key
    if (run / "final_hf" / "config.json").exists() and (run / "sft_eval.json").exists():
        return run
    shutil.rmtree(run, ignore_errors=True)
    cmd = [sys.executable, "-m", "mega_async.cli", "sft", "-c", str(cfg), *ov, f"logging.root_dir={cache_root}",
           "experiment_name=bench_sft", f"trial_name={key}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    logger.info("sft for the scenario: %s", " ".join(cmd))
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env,
                       preexec_fn=child_preexec(signal.SIGTERM, new_session=False))  # ends with the bench
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"bench sft run failed (exit {r.returncode}): {tail}")
    return run


def run_train(config: str, overrides: Sequence[str], run_root: Path, trial: str,
              timeout: float = 1800.0, accuracy: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One training run in a subprocess; its figures from metrics.jsonl plus the peak memory (and, with
    `accuracy` {target, window}, the accuracy figures)."""
    from mega_async.run.report import read_metrics, summarize

    cmd = [sys.executable, "-m", "mega_async.cli", "train", "-c", str(config), *overrides,
           f"logging.root_dir={run_root}", "experiment_name=bench", f"trial_name={trial}",
           "logging.tensorboard=false"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          preexec_fn=child_preexec(signal.SIGTERM)) as proc:  # its own session; ends with the bench
        with PeakRSS(proc.pid) as mem:
            try:
                _, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.communicate()
                raise RuntimeError(f"bench run {trial} took longer than {timeout:.0f}s and was killed")
    if proc.returncode != 0:
        tail = (err.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"bench run {trial} failed (exit {proc.returncode}): {tail}")
    history = read_metrics(run_root / "bench" / trial)
    s = summarize(history)
    figs = {k: s.get(k) for k in TRAIN_FIGURES}
    if accuracy is not None:
        figs.update(accuracy_figures(history, float(accuracy["target"]), int(accuracy.get("window", 3))))
    figs.update({f"split_{k}": s.get("split", {}).get(k) for k in SPLIT_FIGURES})
    figs.update({k: s[k] for k in GEN_FIGURES if k in s})  # generation lengths and their long tail (batch/*)
    figs["peak_rss_mib"] = mem.peak / 2**20 if mem.peak else None
    return {"figures": figs, "staleness_hist": s.get("staleness_hist", {})}


def executor_overhead(trajectories: int = 20000, batch: int = 64, eta: int = 2, rounds: int = 3) -> dict[str, float]:
    """The executor against a bare asyncio.gather of the same episodes (waves of the same concurrency), in
    alternating rounds in this process: medians of trajectories/s, wall-clock ratio and CPU-time ratio (the
    CPU ratio is steadier on a shared machine; the wall ratio also counts waiting on thread hand-offs)."""
    from mega_async.inference.sim.simulated import SimulatedEngine
    from mega_async.rollout.executor import WorkflowExecutor
    from mega_async.rollout.workflow import RLVRWorkflow

    async def areward(prompt: str, completion: str, **_: Any) -> float:
        return 1.0

    engine = SimulatedEngine(vocab_size=100, token_latency=(0.0, 0.0))
    wf = RLVRWorkflow(areward, max_new_tokens=4)
    n = max(batch, trajectories - trajectories % batch)
    conc, item = batch * (eta + 1), {"input_ids": [1, 2, 3]}

    async def gather(total: int) -> None:
        done = 0
        while done < total:
            k = min(conc, total - done)
            await asyncio.gather(*(wf.arun_episode(engine, item) for _ in range(k)))
            done += k

    def direct() -> None:
        asyncio.run(gather(n))

    def executor() -> None:
        with WorkflowExecutor(engine, wf, consumer_batch_size=batch, max_staleness=eta) as ex:
            data = [item] * 64
            for step in range(n // batch):
                ex.prepare_batch(data)
                ex.set_version(step + 1)

    def timed(fn: Any) -> tuple[float, float]:
        w, c = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - w, time.process_time() - c

    asyncio.run(gather(min(n, 2000)))  # warm-up (imports, first-call costs) for both sides
    d, e = [], []
    for _ in range(rounds):
        d.append(timed(direct))
        e.append(timed(executor))
    med = statistics.median
    t_direct, t_exec = med(w for w, _ in d), med(w for w, _ in e)
    return {"trajectories": n, "executor_traj_per_s": n / t_exec, "direct_traj_per_s": n / t_direct,
            "executor_us_per_traj": 1e6 * t_exec / n, "direct_us_per_traj": 1e6 * t_direct / n,
            "executor_vs_direct_ratio": med(we / wd for (we, _), (wd, _) in zip(e, d)),
            "executor_vs_direct_cpu_ratio": med(ce / cd for (_, ce), (_, cd) in zip(e, d) if cd > 0)}


def run_scenario(s: Scenario, run_root: Path, sft_cache: Optional[Path] = None) -> dict[str, Any]:
    """All repeats of one scenario: per-figure values, medians and relative spreads. A scenario with `sft:`
    first gets its SFT model (cached in `sft_cache`) and trains from it (model.path, data.path)."""
    values: dict[str, list[Optional[float]]] = {}
    hist: dict[str, int] = {}
    train_ov = list(s.train.get("overrides", [])) if s.train is not None else []
    sft_figs: dict[str, Any] = {}
    if s.sft is not None:
        sft_dir = prepare_sft(s.sft, sft_cache or run_root)
        train_ov += [f"model.path={sft_dir / 'final_hf'}", f"data.path={sft_dir / 'rl_prompts.jsonl'}"]
        ev = json.loads((sft_dir / "sft_eval.json").read_text())
        sft_figs = {"sft_accuracy_greedy": ev["greedy"], "sft_accuracy_sampled": ev["sampled_t1"]}
    for i in range(s.repeats):
        figs: dict[str, Any] = dict(sft_figs)
        if s.executor is not None:
            e = executor_overhead(**s.executor)
            figs.update({k: v for k, v in e.items() if k != "trajectories"})
        if s.serve is not None:
            from mega_async.bench.serving import serve_figures

            figs.update(serve_figures(s.serve, run_root / f"{s.name}_r{i}")["figures"])
        if s.train is not None:
            t = run_train(s.train["config"], train_ov, run_root, f"{s.name}_r{i}", accuracy=s.accuracy)
            figs.update(t["figures"])
            for k, v in t["staleness_hist"].items():
                hist[str(k)] = hist.get(str(k), 0) + v
        for k, v in figs.items():
            values.setdefault(k, []).append(v)
        logger.info("scenario %s repeat %d/%d: %s", s.name, i + 1, s.repeats,
                    ", ".join(f"{k} {v:.4g}" for k, v in figs.items() if isinstance(v, (int, float))))
    return {"repeats": s.repeats, "description": s.description, "figures": {
        k: bench_gate.stat(vs) for k, vs in values.items()}, "staleness_hist": hist, "rules": s.figures}


def environment() -> dict[str, Any]:
    """Machine, library versions and git commit of this result."""
    from importlib import metadata

    def ver(name: str) -> Optional[str]:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    def git(*args: str) -> Optional[str]:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    gpu = None
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        pass
    return {"machine": {"host": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": platform.python_version(), "gpu": gpu, "load_avg": list(os.getloadavg())},
            "versions": {n: ver(n) for n in ("torch", "megatron-core", "transformers", "mega_async", "numpy")},
            "git": {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}}


# ---- CLI -------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="mega-async bench", description=__doc__.splitlines()[0])
    ap.add_argument("scenarios", nargs="*", help="names under configs/bench/ or YAML paths (default: all)")
    ap.add_argument("--baseline", default=None, help="baseline JSON (default benchmarks/baselines/<cpu|gpu>.json)")
    ap.add_argument("--update-baseline", action="store_true", help="write this result as the new baseline")
    ap.add_argument("--out", default="runs/bench/result.json", help="where the JSON result is written")
    ap.add_argument("--result", default=None, help="compare this recorded result instead of running anything")
    ap.add_argument("--repeats", type=int, default=None, help="override every scenario's repeats")
    ap.add_argument("--history-dir", default="benchmarks/history", help="history.jsonl and history.png go here")
    ap.add_argument("--sft-cache", default="runs/bench_sft_cache",
                    help="SFT runs of scenarios with sft: (one per config, reused across nights)")
    ap.add_argument("--no-history", action="store_true", help="do not append to the history")
    ap.add_argument("--noise-k", type=float, default=2.0, help="tolerance >= noise_k x the relative spread")
    return ap.parse_args(argv)


def _measure(a: argparse.Namespace) -> dict[str, Any]:
    scenarios = find_scenarios(a.scenarios)
    if a.repeats is not None:
        if a.repeats < 1:
            raise BenchError(f"--repeats={a.repeats} must be >= 1")
        for s in scenarios:
            s.repeats = a.repeats
    result = {"schema": bench_gate.SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              **environment(), "scenarios": {}}
    with tempfile.TemporaryDirectory(prefix="mega_async_bench_") as tmp:
        for s in scenarios:
            logger.info("scenario %s: %d repeat(s) (%s)", s.name, s.repeats, s.path)
            result["scenarios"][s.name] = run_scenario(s, Path(tmp), Path(a.sft_cache).resolve())
    result["machine"]["load_avg_after"] = list(os.getloadavg())
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        result = bench_gate.load_json(a.result, "result") if a.result else _measure(a)
        if not a.result:
            bench_gate.save_json(result, a.out)
            print(f"result: {a.out}")
        baseline_path = Path(a.baseline or bench_gate.default_baseline(result))
        if a.update_baseline:  # scenarios not run this time keep their old baseline, and where it was measured
            old = bench_gate.load_json(baseline_path, "baseline") if baseline_path.exists() else {"scenarios": {}}
            baseline = {**result, "scenarios": bench_gate.merge_baseline(old, result)}
            bench_gate.save_json(baseline, baseline_path)
            print(f"baseline written: {baseline_path} (scenarios {', '.join(result['scenarios'])} refreshed)")
        else:
            baseline = bench_gate.load_json(baseline_path, "baseline") if baseline_path.exists() else None
        verdicts = bench_gate.compare(result, baseline, noise_k=a.noise_k)
        print(bench_gate.table(verdicts, result, baseline_path if baseline else None))
        if not a.no_history and not a.result:
            png = bench_gate.append_history(result, Path(a.history_dir))
            print(f"history: {Path(a.history_dir) / 'history.jsonl'}, plot {png}")
    except (BenchError, bench_gate.GateError, FileNotFoundError, RuntimeError) as e:
        print(f"mega-async bench: {e}", file=sys.stderr)
        return 2
    bad = [v for v in verdicts if v["verdict"] == "REGRESSED"]
    if bad:
        print(f"mega-async bench: {len(bad)} figure(s) regressed: "
              + ", ".join(f"{v['scenario']}/{v['figure']}" for v in bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
