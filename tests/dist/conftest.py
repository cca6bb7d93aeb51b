"""Shared fixtures of the multi-rank tests.

`dist_runs`: the default jobs of every module of the session that asks for them, in one torchrun launch per rank
count (tests/dist/jobs.py). A module declares `dist_jobs(weights, out) -> {name: (nproc, [script, *args])}` and
reads `dist_runs.of(module)` ({name: None if it passed on every rank, else what went wrong}) and
`dist_runs.out(module)` (the folder its jobs were given). Only the modules whose collected tests use the fixture
are run, so `pytest tests/dist/test_engine.py` launches the engine's jobs alone."""
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from mega_async.bridge.model_cards import TINY_DENSE, TINY_MOE, init_random_weights
from tests.dist.jobs import run_grouped


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory):
    """The tiny Qwen3-MoE and dense cards with random weights (seed 0), written once; tests only read them."""
    root = tmp_path_factory.mktemp("tiny")
    return {"moe": init_random_weights(TINY_MOE, root / "moe", seed=0),
            "dense": init_random_weights(TINY_DENSE, root / "dense", seed=0)}


@dataclass
class DistRuns:
    root: Path
    results: dict[str, Optional[str]]

    @staticmethod
    def _name(module: str) -> str:
        return module.rsplit(".", 1)[-1]

    def out(self, module: str) -> Path:
        return self.root / self._name(module)

    def of(self, module: str) -> dict[str, Optional[str]]:
        """{job name: None if it passed on every rank, else what went wrong} of one module."""
        prefix = self._name(module) + "."
        return {k[len(prefix):]: v for k, v in self.results.items() if k.startswith(prefix)}


@pytest.fixture(scope="session")
def dist_runs(request, tiny_weights, tmp_path_factory) -> DistRuns:
    root = tmp_path_factory.mktemp("dist_runs")
    modules = {item.module.__name__: item.module for item in request.session.items
               if "dist_runs" in getattr(item, "fixturenames", ()) and hasattr(item.module, "dist_jobs")}
    cases: dict = {}
    for key in sorted(modules):
        name = DistRuns._name(key)
        cases.update({f"{name}.{job}": spec for job, spec in modules[key].dist_jobs(tiny_weights, root / name).items()})
    return DistRuns(root, run_grouped(cases, root / "launches") if cases else {})
