"""Executor overhead with an instant engine: trajectories/s and microseconds per trajectory.

Baseline in the same run: the same workflow episodes driven directly by asyncio.gather in
waves of the same concurrency (no staleness gating, no thread hop, no ordering). The ratio is
the cost of the rollout layer's bookkeeping; generation on a real server dwarfs both.

    python tools/bench_executor.py --trajectories 20000
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from mega_async.inference.simulated import SimulatedEngine
from mega_async.rollout.executor import WorkflowExecutor
from mega_async.rollout.workflow import RLVRWorkflow


def reward(prompt: str, completion: str, **_: object) -> float:
    return 1.0


async def areward(prompt: str, completion: str, **_: object) -> float:
    return 1.0


def bench_direct(n: int, concurrency: int, wf: RLVRWorkflow, engine: SimulatedEngine) -> float:
    async def main() -> None:
        done = 0
        while done < n:
            k = min(concurrency, n - done)
            await asyncio.gather(*(wf.arun_episode(engine, {"input_ids": [1, 2, 3]}) for _ in range(k)))
            done += k

    t0 = time.perf_counter()
    asyncio.run(main())
    return time.perf_counter() - t0


def bench_executor(n: int, B: int, eta: int, wf: RLVRWorkflow, engine: SimulatedEngine) -> float:
    data = [{"input_ids": [1, 2, 3]}] * 64
    with WorkflowExecutor(engine, wf, consumer_batch_size=B, max_staleness=eta) as ex:
        t0 = time.perf_counter()
        for step in range(n // B):
            ex.prepare_batch(data)
            ex.set_version(step + 1)
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--eta", type=int, default=2)
    ap.add_argument("--reward", choices=["async", "sync"], default="async",
                    help="sync rewards add a thread-pool hop per trajectory to both sides")
    args = ap.parse_args()
    engine = SimulatedEngine(vocab_size=100, token_latency=(0.0, 0.0))
    wf = RLVRWorkflow(areward if args.reward == "async" else reward, max_new_tokens=4)
    n = args.trajectories - args.trajectories % args.batch
    conc = args.batch * (args.eta + 1)
    bench_direct(min(n, 2000), conc, wf, engine)  # warm-up
    t_direct = bench_direct(n, conc, wf, engine)
    t_exec = bench_executor(n, args.batch, args.eta, wf, engine)
    res = {
        "trajectories": n,
        "executor_traj_per_s": round(n / t_exec),
        "executor_us_per_traj": round(1e6 * t_exec / n, 1),
        "direct_traj_per_s": round(n / t_direct),
        "direct_us_per_traj": round(1e6 * t_direct / n, 1),
        "executor_overhead_us_per_traj": round(1e6 * (t_exec - t_direct) / n, 1),
        "executor_vs_direct_time_ratio": round(t_exec / t_direct, 2),
    }
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
