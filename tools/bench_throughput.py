"""The nightly throughput benchmark (same as `mega-async bench`): scenarios from configs/bench/, a JSON
result, the regression gate against benchmarks/baselines/, the history and its plot.

    python tools/bench_throughput.py                      # all scenarios, gate against the baseline
    python tools/bench_throughput.py executor --repeats 3
    python tools/bench_throughput.py --update-baseline    # refresh the checked-in baseline
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mega_async.bench.scenarios import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
