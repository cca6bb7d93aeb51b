"""tools/soak_memory.py's growth figure: the least-squares slope of RSS past the warm-up, per 100 steps."""
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("soak_memory", Path(__file__).resolve().parents[2] / "tools" / "soak_memory.py")
soak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(soak)


def test_growth_is_the_slope_past_the_warmup():
    # 40 MiB of warm-up growth over the first 100 steps, then 2 MiB per 100 steps with +-1 MiB of alternating noise
    samples = [(s, int(1024 * (500 + 0.4 * s))) for s in range(0, 100)]
    samples += [(s, int(1024 * (540 + 0.02 * (s - 100) + (1 if s % 2 else -1)))) for s in range(100, 400)]
    assert abs(soak.growth_per_100(samples, 100) - 2.0) < 0.1
    assert soak.growth_per_100(samples, 0) > 5  # the warm-up counted in: a leak it is not
    assert soak.growth_per_100(samples[:2], 0) is None  # too few points to say
