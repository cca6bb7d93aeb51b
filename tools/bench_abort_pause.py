"""The abort pause alone: N fleet servers, C long requests from our SGLangClient on a rollout loop
(AsyncTaskRunner, as the executor runs them), then one `pause_generation(mode="abort")` from a second thread, as
the weight sync sends it. Reports the pause's wall time and the CPU the controller and the fleet spent in it,
with the rollout loop parked during the pause calls (`AsyncTaskRunner.parked`, what the sync does) and without,
and (`--baseline REF`) with client and fleet of an older commit, unparked (`--baseline-parked`: parked); the
variants alternate on fresh fleets in one run, each round in its own process.

    python tools/bench_abort_pause.py --servers 256 --inflight 7440 --rounds 2 --baseline c9f3640 \
        --out benchmarks/scale/abort_pause.json
    python tools/bench_abort_pause.py --rounds 3 --baseline 43ca631 --baseline-parked \
        --out benchmarks/scale/abort_pause_fleet.json
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bench_scale import cpu_of, export  # noqa: E402 - tools/ is this script's own folder on sys.path


def one_round(a: argparse.Namespace, park: bool) -> dict:
    from mega_async.inference.client import SGLangClient
    from mega_async.inference.sim.fleet import Fleet, FleetConfig
    from mega_async.rollout.runner import AsyncTaskRunner
    from mega_async.api.types import ModelRequest, WeightVersion

    # long answers (no stop before max_new_tokens is likely), so every request is running when the pause comes
    cfg = FleetConfig(length_median=400, length_sigma=0.1, token_latency_s=0.02, batch_latency_s=0.0, ttft_s=0.0,
                      max_running_requests=max(256, -(-a.inflight // a.servers)), keepalive_s=60)
    with Fleet(a.servers, cfg, procs=a.fleet_procs) as fleet:
        pids = [p.pid for p in fleet._workers]
        client = SGLangClient(fleet.addresses, version=WeightVersion(), request_timeout=600)
        runner = AsyncTaskRunner(name="rollout")
        runner.start()
        answered = [0]

        def episode(i: int):
            async def run(_token):
                await client.agenerate(ModelRequest(input_ids=[i + 1] + list(range(3, 130)), max_new_tokens=512,
                                                    stop_token_ids=[2]))
            return run

        def done(_tid, _result, _exc):
            answered[0] += 1

        for i in range(a.inflight):
            runner.submit(i, episode(i), done, wake=False)
        runner.wake()
        t0 = time.monotonic()
        while client._in_flight < a.inflight and time.monotonic() - t0 < 120:
            time.sleep(0.1)
        time.sleep(a.run_s)  # partial outputs of about run_s * 50 tokens
        in_flight = client._in_flight
        sync_loop = asyncio.new_event_loop()
        client.pause()
        c0, f0, w0 = time.process_time(), cpu_of(pids), time.perf_counter()
        with runner.parked(600) if park else contextlib.nullcontext():
            sync_loop.run_until_complete(client.pause_generation(mode="abort", timeout=300))
        w1, c1, f1 = time.perf_counter(), time.process_time(), cpu_of(pids)
        aborted = sum(s["counters"].get("aborted", 0) for s in fleet.state())
        client.resume()
        sync_loop.run_until_complete(client.continue_generation())
        runner.stop()
        sync_loop.run_until_complete(client.aclose())
        sync_loop.close()
    return {"park": park, "pause_s": w1 - w0, "controller_cpu_s": c1 - c0, "fleet_cpu_s": f1 - f0,
            "in_flight": in_flight, "aborted": aborted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", type=int, default=256)
    ap.add_argument("--inflight", type=int, default=7440, help="requests running when the pause comes")
    ap.add_argument("--fleet-procs", type=int, default=2)
    ap.add_argument("--run-s", type=float, default=5.0, help="seconds the requests run before the pause")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each variant, alternating")
    ap.add_argument("--baseline", default=None, help="git ref whose client and fleet run too (unparked)")
    ap.add_argument("--baseline-parked", action="store_true",
                    help="run the baseline parked (a ref that has AsyncTaskRunner.parked: 3c276ec or later)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--round", choices=["parked", "unparked"], default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.round:  # one round, on the mega_async that PYTHONPATH names
        print(json.dumps(one_round(a, a.round == "parked")))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_abort_pause_") as d:
        variants = [("current", ROOT, "unparked"), ("current", ROOT, "parked")]
        if a.baseline:
            variants.insert(0, (a.baseline, export(a.baseline, Path(d)), "parked" if a.baseline_parked else "unparked"))
        for _ in range(a.rounds):
            for name, tree, mode in variants:
                cmd = [sys.executable, str(Path(__file__).resolve()), "--round", mode] + [
                    f"--{k.replace('_', '-')}={getattr(a, k)}" for k in ("servers", "inflight", "fleet_procs", "run_s")]
                # cwd: the fleet's workers run `python -m mega_async.inference.sim.fleet`, which looks there first
                r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(tree)}, cwd=str(tree),
                                   capture_output=True, text=True, timeout=600)
                if r.returncode != 0:
                    raise SystemExit(f"{name} {mode} failed:\n{r.stderr[-3000:]}")
                rows.append({"variant": f"{name} {mode}", **json.loads(r.stdout.strip().splitlines()[-1])})
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}),
                      flush=True)
    variants = dict.fromkeys(r["variant"] for r in rows)
    med = {v: {k: round(statistics.median(r[k] for r in rows if r["variant"] == v), 3)
               for k in ("pause_s", "controller_cpu_s", "fleet_cpu_s")} for v in variants}
    parked = med["current parked"]["pause_s"]
    summary = {"median": med, "pause_s / current parked": {v: round(m["pause_s"] / parked, 3) for v, m in med.items()}}
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "cpus": os.cpu_count(), "summary": summary,
                                           "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
