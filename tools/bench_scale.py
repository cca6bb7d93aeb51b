"""Controller cost at scale: our real client, executor and sync pause bracket against a simulated fleet.

For each (N servers, C requests in flight) it starts a fresh fleet (mega_async.inference.sim.fleet) and runs a
controller process: WorkflowExecutor(max_concurrent=C, B=C/4, max_staleness=3) over SGLangClient, one weight
sync per step (the sync's pause bracket + the distributed sync's control plane: begin session, buckets, commit,
end; no broadcast). It reports controller CPU seconds per consumed trajectory and per step, the pause
bracket's latency (enter and leave), the sync control plane's latency, and checks that no request was lost
or trained twice and every token's version label is the version the server generated it with (fleet logprobs
encode it) within max_staleness. `--baseline REF` runs the controller of an older commit (git archive) on the
same fleets, alternating, so before/after ratios come from one run.

    python tools/bench_scale.py --servers 4,16,64,256 --inflight 4096 --baseline 541c0b9 \\
        --out benchmarks/scale/scale.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MAX_STALENESS = 3


# ---- the controller (runs in its own process, on the variant's mega_async) ------------------------------
def controller(a: argparse.Namespace) -> dict:
    import gc
    import math
    import random
    import resource
    import threading

    import torch

    from mega_async.inference.client import SGLangClient
    from mega_async.rollout.executor import WorkflowExecutor
    from mega_async.rollout.workflow import RLVRWorkflow
    from mega_async.trainer.sync import RolloutSide, Transport, WeightSync
    from mega_async.api.types import WeightVersion

    addresses = Path(a.addresses_file).read_text().split()
    C, B = a.inflight, max(1, a.inflight // (MAX_STALENESS + 1))
    version = WeightVersion()
    marks: dict[str, list[float]] = {}
    cpu_marks: dict[str, tuple[float, float]] = {}  # phase mark -> (this process's CPU s, the fleet's CPU s)
    fleet_pids = [int(p) for p in a.fleet_pids.split(",") if p] if a.fleet_pids else []
    gc_passes: list[tuple[float, float]] = []  # (end, seconds) of every cyclic-GC pass in this process
    gc_began = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_began[0] = time.perf_counter()
        else:
            now = time.perf_counter()
            gc_passes.append((now, now - gc_began[0]))

    gc.callbacks.append(on_gc)

    class Events:  # the sync's timeline, kept in memory (phase -> perf_counter at start/end)
        def emit(self, kind: str, phase: str = "", **_: object) -> None:
            marks.setdefault(f"{kind}:{phase}", []).append(time.perf_counter())
            if kind.startswith("sync_"):  # who spends the bracket's CPU: the controller or the simulated servers
                cpu_marks[f"{kind}:{phase}"] = (time.process_time(), cpu_of(fleet_pids))

        def span(self, kind: str, phase: str = "", **_: object):
            import contextlib

            @contextlib.contextmanager
            def cm():
                self.emit(f"{kind}_start", phase)
                try:
                    yield
                finally:
                    self.emit(f"{kind}_end", phase)
            return cm()

    class Workflow(RLVRWorkflow):
        async def arun_episode(self, engine, data):
            out = await super().arun_episode(engine, data)
            if out is not None:
                out["uid"] = data["uid"]
            return out

    async def reward(prompt, completion, **item):
        return float(len(item["output_tokens"]) % 2)

    class ControlPlane(Transport):
        """distributed_sync's HTTP sequence (begin, buckets, commit, end) without the broadcast."""

        def update(self, target: int):
            c, t = self.ctx.rollout.client, self.ctx.timeout
            t0 = time.perf_counter()
            calls = []

            def run(coro):
                t1 = time.perf_counter()
                self.ctx.loop.run(coro, t + 10)
                calls.append(round(time.perf_counter() - t1, 4))

            run(c.begin_weight_update(timeout=t))
            for k in range(a.buckets):  # SGLang's flattened buckets: largest dtype first, the flush at the commit
                names = [f"model.layers.{k}.w{i}" for i in range(32)]
                run(c.update_weights_from_distributed(names, ["bfloat16"] * 32, [[1024, 1024]] * 32, "bench",
                                                      load_format="flattened_bucket", timeout=t, flush_cache=False))
            run(c.update_weights_from_distributed([], [], [], "bench", version=target, timeout=t,
                                                  flush_cache=self.ctx.flush_cache))
            run(c.end_weight_update(timeout=t))
            marks.setdefault("control", []).append(time.perf_counter() - t0)
            marks.setdefault("calls", []).append(calls)
            return None

    client = SGLangClient(addresses, version=version, request_timeout=a.request_timeout, unhealthy_timeout=120)
    workflow = Workflow(reward, max_new_tokens=a.max_new_tokens, stop_token_ids=[2])
    ex = WorkflowExecutor(client, workflow, consumer_batch_size=B, max_staleness=MAX_STALENESS,
                          max_concurrent_rollouts=C, version=version, max_consecutive_failures=None)
    sync = WeightSync([], version, RolloutSide(client, ex), ControlPlane(), timeout=300, events=Events(),
                      interrupt=a.interrupt)
    t0 = time.perf_counter()
    sync._loop.run(client.init_weights_update_group("127.0.0.1", 29999, "bench", timeout=300), 310)
    init_s = time.perf_counter() - t0
    rng = random.Random(0)
    pool = [rng.randrange(3, 30000) for _ in range(1 << 16)]
    submitted = [0]

    def items():  # distinct prompts (the fleet seeds each one's length by its tokens)
        while True:
            submitted[0] += 1
            k = (submitted[0] * 7919) % (len(pool) - a.prompt_tokens)
            yield {"uid": submitted[0], "input_ids": [submitted[0]] + pool[k:k + a.prompt_tokens - 1]}

    tick = os.sysconf("SC_CLK_TCK")

    def thread_cpu() -> dict[str, float]:
        """CPU seconds of the controller's threads: rollout-runner (client + executor + workflow), sync-http (the
        sync's HTTP calls), MainThread (the consumer), from /proc (the loops run in their own threads)."""
        out: dict[str, float] = {}
        for t in threading.enumerate():
            try:
                f = Path(f"/proc/self/task/{t.native_id}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, TypeError):
                continue
            key = t.name if t.name in ("rollout-runner", "sync-http") else "main"
            out[key] = out.get(key, 0.0) + (int(f[11]) + int(f[12])) / tick
        return out

    loader = items()
    seen: set[int] = set()
    problems = {"duplicates": 0, "bad_labels": 0, "too_stale": 0, "decreasing": 0}
    steps, total = [], a.warmup + a.steps
    ex.start()
    try:
        for step in range(total):
            c0, w0, t0 = time.process_time(), time.perf_counter(), thread_cpu()
            batch = ex.prepare_batch(loader)
            w1 = time.perf_counter()
            now = version.value
            for traj in batch:
                if traj["uid"] in seen:
                    problems["duplicates"] += 1
                seen.add(traj["uid"])
                m = traj["loss_mask"][0].bool()
                v, lp = traj["versions"][0][m], traj["logprobs"][0][m]
                problems["bad_labels"] += int((torch.floor(-lp).long() != v).sum())
                problems["too_stale"] += int(v.numel() > 0 and int(v.min()) < now - MAX_STALENESS)
                problems["decreasing"] += int(v.numel() > 1 and bool((v[1:] < v[:-1]).any()))
            in_flight = sum(s.in_flight for s in client.servers)  # requests on the wire
            running = ex.stats["running"]  # episodes running (on the wire, or held in the client for a connection)
            marks.clear()
            w2 = time.perf_counter()
            sync.push()
            w3 = time.perf_counter()
            t3 = thread_cpu()
            by_thread = {k: t3.get(k, 0.0) - t0.get(k, 0.0) for k in t3}
            pause = marks.get("sync_end:pause", [w2])[0] - marks.get("sync_start:pause", [w2])[0]
            p0, p1 = cpu_marks.get("sync_start:pause", (0.0, 0.0)), cpu_marks.get("sync_end:pause", (0.0, 0.0))
            b0, b1 = marks.get("sync_start:pause", [w2])[0], marks.get("sync_end:continue", [w3])[0]
            gc_step = sum(d for end, d in gc_passes if w0 <= end <= w3)
            gc_bracket = sum(d for end, d in gc_passes if b0 <= end <= b1)
            cpu_marks.clear()
            cont = marks.get("sync_end:continue", [w3])[0] - marks.get("sync_start:continue", [w3])[0]
            steps.append({"step": step, "wait_s": w1 - w0, "push_s": w3 - w2, "pause_s": pause, "continue_s": cont,
                          "bracket_s": pause + cont, "control_s": marks.get("control", [math.nan])[0],
                          "control_calls_s": marks.get("calls", [[]])[0],
                          "cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0,
                          "rollout_cpu_s": by_thread.get("rollout-runner", 0.0) + by_thread.get("main", 0.0),
                          "sync_cpu_s": by_thread.get("sync-http", 0.0),
                          "pause_cpu_s": p1[0] - p0[0], "pause_fleet_cpu_s": p1[1] - p0[1],
                          "gc_s": gc_step, "bracket_gc_s": gc_bracket,
                          "consumed": len(batch), "in_flight_at_sync": in_flight,
                          "running_at_sync": running})
            print(json.dumps({k: round(x, 4) if isinstance(x, float) else x for k, x in steps[-1].items()}),
                  file=sys.stderr, flush=True)
        st = ex.stats
        idle = []  # the bracket's fan-outs alone: pause + continue every server with nothing in flight
        with sync.pause_bracket():
            for _ in range(3):
                t0 = time.perf_counter()
                sync._loop.run(client.pause_generation(mode="abort", timeout=300), 310)
                sync._loop.run(client.continue_generation(), 310)
                idle.append(time.perf_counter() - t0)
    finally:
        ex.stop()
        sync.close()
    measured = steps[a.warmup:]
    cpu, consumed = sum(s["cpu_s"] for s in measured), sum(s["consumed"] for s in measured)
    # every item handed to the executor is consumed, ready, running or waiting; nothing failed or vanished
    lost = submitted[0] - (st["consumed"] + st["ready"] + st["running"] + st["enqueued"])
    med = lambda k: sorted(s[k] for s in measured)[len(measured) // 2]  # noqa: E731
    rollout_cpu, sync_cpu = sum(s["rollout_cpu_s"] for s in measured), sum(s["sync_cpu_s"] for s in measured)
    return {"servers": len(addresses), "inflight": C, "batch": B, "steps": len(measured),
            "consumed": consumed, "cpu_per_traj_ms": 1e3 * cpu / consumed, "cpu_per_step_s": cpu / len(measured),
            "rollout_cpu_per_traj_ms": 1e3 * rollout_cpu / consumed, "sync_cpu_per_step_s": sync_cpu / len(measured),
            "sync_cpu_per_server_step_ms": 1e3 * sync_cpu / len(measured) / len(addresses),
            "traj_per_s": consumed / sum(s["wall_s"] for s in measured), "bracket_s": med("bracket_s"),
            "pause_s": med("pause_s"), "pause_cpu_s": med("pause_cpu_s"), "pause_fleet_cpu_s": med("pause_fleet_cpu_s"),
            "gc_s": med("gc_s"), "bracket_gc_s": med("bracket_gc_s"),
            "continue_s": med("continue_s"), "control_s": med("control_s"),
            "bracket_max_s": max(s["bracket_s"] for s in measured), "bracket_idle_s": sorted(idle)[1],
            "init_group_s": init_s,
            "in_flight_at_sync": med("in_flight_at_sync"), "running_at_sync": med("running_at_sync"), "failed": st["failed"], "rejected": st["rejected"],
            "lost": lost, **problems, "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "threads": threading.active_count(), "per_step": steps}


# ---- the orchestrator ------------------------------------------------------------------------------------
def fleet_config(a: argparse.Namespace, n: int, c: int) -> dict:
    """Latency so that ~`--throughput` trajectories/s finish when C are in flight: mean latency = C / T."""
    mean_tokens = a.length_median * 2.718281828 ** (a.length_sigma ** 2 / 2)
    per_token = c / (a.throughput * min(mean_tokens, a.max_new_tokens))
    per_server = -(-c // n)  # half of a token's latency is the server's batch (it falls as the batch drains)
    return {"seed": 0, "length_median": a.length_median, "length_sigma": a.length_sigma,
            "token_latency_s": per_token / 2, "batch_latency_s": per_token / (2 * per_server), "ttft_s": 0.0,
            "max_running_requests": max(256, per_server), "load_s": 0.0, "keepalive_s": 5.0}


def request_timeout(a: argparse.Namespace, cfg: Any, n: int, c: int) -> float:
    """Twice the fleet's longest answer (max_new_tokens at a full server's per-token latency), at least 600 s: at
    65,536 in flight a 512-token answer takes ~40 minutes by design (C / throughput), and a request timing out is
    a failure of the server it went to."""
    per_token = cfg.token_latency_s + cfg.batch_latency_s * -(-c // n)
    return round(max(600.0, 2 * a.max_new_tokens * per_token), 1)


def cpu_of(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in pids:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / tick
        except (OSError, IndexError):
            pass
    return total


def run_one(a: argparse.Namespace, variant: str, tree: Path, n: int, c: int, tmp: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from mega_async.inference.sim.fleet import Fleet, FleetConfig

    cfg = FleetConfig(**fleet_config(a, n, c))
    procs = max(1, min(a.fleet_procs, n))
    with Fleet(n, cfg, procs=procs, log_dir=str(tmp)) as fleet:
        addr = tmp / f"fleet_{n}.txt"
        addr.write_text("\n".join(fleet.addresses) + "\n")
        out = tmp / f"{variant}_{n}_{c}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--controller", "--addresses-file", str(addr),
               "--inflight", str(c), "--json-out", str(out)] + [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in (
                   "steps", "warmup", "buckets", "max_new_tokens", "prompt_tokens", "interrupt")] + [
                   f"--request-timeout={request_timeout(a, cfg, n, c)}",
                   "--fleet-pids=" + ",".join(str(p.pid) for p in fleet._workers)]
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        fleet_cpu0 = cpu_of([p.pid for p in fleet._workers])
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env, cwd=str(tmp), stderr=subprocess.PIPE, text=True, timeout=a.timeout)
        wall = time.perf_counter() - t0
        fleet_cpu = cpu_of([p.pid for p in fleet._workers]) - fleet_cpu0
        counters = [s["counters"] for s in fleet.state()]
    if r.returncode != 0:
        raise RuntimeError(f"{variant} controller at N={n}, C={c} failed:\n{r.stderr[-4000:]}")
    res = json.loads(out.read_text())
    res.update(variant=variant, wall_s=wall, fleet_cpu_s=fleet_cpu, fleet_requests=sum(x.get("requests", 0)
               for x in counters), fleet_aborted=sum(x.get("aborted", 0) for x in counters))
    return res


def export(ref: str, tmp: Path) -> Path:
    """The mega_async package of commit `ref`, unpacked under tmp (its controller code, our fleet)."""
    dest = tmp / f"tree_{ref}"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "mega_async"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def summary(rows: list[dict]) -> dict:
    """Ratios within the run: per-trajectory CPU against the smallest N (and C), baseline/current."""
    out: dict = {}
    rows = [r for r in rows if "error" not in r]
    metrics = ("cpu_per_traj_ms", "rollout_cpu_per_traj_ms", "sync_cpu_per_server_step_ms")
    for variant in sorted({r["variant"] for r in rows}):
        mine = [r for r in rows if r["variant"] == variant]
        for key, fixed in (("servers", "inflight"), ("inflight", "servers")):
            for f in sorted({r[fixed] for r in mine}):
                line = sorted((r for r in mine if r[fixed] == f), key=lambda r: r[key])
                if len(line) > 1:
                    for m in metrics:
                        out[f"{variant}: {m} at {fixed}={f}, {key} {line[0][key]}->{line[-1][key]}"] = round(
                            line[-1][m] / line[0][m], 3)
    for r in rows:
        if r["variant"] == "baseline":
            cur = next((x for x in rows if x["variant"] == "current" and x["servers"] == r["servers"]
                        and x["inflight"] == r["inflight"]), None)
            if cur:
                for m in metrics + ("bracket_s", "pause_s", "bracket_idle_s", "control_s"):
                    out[f"baseline/current {m} at N={r['servers']}, C={r['inflight']}"] = round(r[m] / cur[m], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--servers", default="4,16,64,256")
    ap.add_argument("--inflight", default="4096,1024,16384", help="requests in flight (comma list)")
    ap.add_argument("--grid", action="store_true", help="every (N, C) pair; default: the N sweep at the first C "
                                                        "and the C sweep at the last N")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--buckets", type=int, default=8, help="weight buckets per sync (control messages)")
    ap.add_argument("--throughput", type=float, default=100.0, help="trajectories/s the fleet's latency targets")
    ap.add_argument("--length-median", type=float, default=96.0)
    ap.add_argument("--length-sigma", type=float, default=0.8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--interrupt", default="abort", choices=["abort", "retract", "in_place", "none"])
    ap.add_argument("--fleet-procs", type=int, default=2)
    ap.add_argument("--baseline", default=None, help="git ref whose controller is measured too, alternating")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per controller run")
    ap.add_argument("--out", default=None, help="write the JSON here (e.g. benchmarks/scale/scale.json)")
    # controller mode (one run; started by the orchestrator)
    ap.add_argument("--controller", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--addresses-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--request-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    ap.add_argument("--fleet-pids", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.controller:
        a.inflight = int(a.inflight)
        Path(a.json_out).write_text(json.dumps(controller(a)))
        return
    ns, cs = [int(x) for x in a.servers.split(",")], [int(x) for x in a.inflight.split(",")]
    pairs = [(n, c) for n in ns for c in cs] if a.grid else list(dict.fromkeys(
        [(n, cs[0]) for n in ns] + [(ns[-1], c) for c in cs]))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as d:
        tmp = Path(d)
        trees = [("current", ROOT)] + ([("baseline", export(a.baseline, tmp))] if a.baseline else [])
        for n, c in pairs:
            for variant, tree in trees:
                try:
                    r = run_one(a, variant, tree, n, c, tmp)
                except (RuntimeError, subprocess.TimeoutExpired) as e:  # recorded; the sweep goes on
                    r = {"variant": variant, "servers": n, "inflight": c, "error": str(e)[-2000:]}
                rows.append(r)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                                  if k != "per_step"}), flush=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"commit": commit, "baseline": a.baseline, "args": {k: v for k, v in vars(a).items()
                                                                 if k not in ("controller", "json_out")},
              "cpus": os.cpu_count(), "summary": summary(rows), "rows": rows}
    print(json.dumps(result["summary"], indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
