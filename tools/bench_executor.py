"""Executor overhead with an instant engine: trajectories/s of the WorkflowExecutor against a bare
asyncio.gather of the same workflow episodes in waves of the same concurrency (no staleness gating, no
thread hop, no ordering), in alternating rounds in the same run; medians. The ratio is the cost of the
rollout layer's bookkeeping; generation on a real server dwarfs both. (Also the `executor` bench scenario.)

    python tools/bench_executor.py --trajectories 20000 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mega_async.bench.scenarios import executor_overhead  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--eta", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="alternating direct/executor rounds (medians)")
    a = ap.parse_args()
    res = executor_overhead(a.trajectories, a.batch, a.eta, a.rounds)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}, indent=1))


if __name__ == "__main__":
    main()
