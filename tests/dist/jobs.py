"""Several torchrun worker scripts in one launch: each process imports torch, Megatron-Core and the bridge once
(about 10 s a launch on 2 cores) and runs the scripts one after another, as `torchrun <script> <args>` would,
with Megatron's parallel state torn down between them, the environment restored, and torch.distributed's default
group kept.

    results = run_jobs(2, {"tp2": ["engine_worker.py", "--layout", "megatron:t2", ...], ...}, out_dir)
    assert results["tp2"] is None, results["tp2"]     # None: passed; else the rank's traceback

A job that fails on any rank ends the launch there (a rank left in a collective would wait for gloo's timeout):
its error is that job's result, and the jobs after it report that they did not run.
"""
from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def torchrun(script: str, nproc: int, *args: str) -> None:
    """One worker script in its own launch (`torchrun --nproc-per-node=nproc tests/dist/<script> <args>`)."""
    from mega_async.utils.comm import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           str(HERE / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, f"{script} {args} failed:\n{r.stderr[-6000:]}"


def run_jobs(nproc: int, jobs: dict[str, list[str]], out_dir: Path, timeout: float = 1200) -> dict[str, Optional[str]]:
    """Run `jobs` ({name: [script in tests/dist, *args]}) in order in one torchrun launch of `nproc` ranks;
    returns {name: None if it passed on every rank, else what went wrong}."""
    from mega_async.utils.comm import free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "jobs.json"
    spec.write_text(json.dumps(jobs))
    pre = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}"]
    cmd = (pre if nproc > 1 else [sys.executable]) + [str(HERE / "jobs.py"), str(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    results: dict[str, Optional[str]] = {}
    for name in jobs:
        errors = sorted(out_dir.glob(f"{name}.rank*.err"))
        if errors:
            results[name] = "\n".join(p.read_text() for p in errors)
        elif (out_dir / f"{name}.done").exists():
            results[name] = None
        else:
            results[name] = f"did not run: the launch ended before it (exit {r.returncode}):\n{r.stderr[-6000:]}"
    if r.returncode != 0 and all(v is None for v in results.values()):  # e.g. a rank aborted at exit: as torchrun
        results = {name: f"every job ran, but the launch exited with {r.returncode}:\n{r.stderr[-6000:]}"
                   for name in jobs}
    return results


def run_grouped(cases: dict[str, tuple[int, list[str]]], out_dir: Path) -> dict[str, Optional[str]]:
    """{name: (nproc, [script, *args])}: one launch per rank count, fewest ranks first; {name: error or None}."""
    results: dict[str, Optional[str]] = {}
    for nproc in sorted({n for n, _ in cases.values()}):
        jobs = {name: job for name, (n, job) in cases.items() if n == nproc}
        results.update(run_jobs(nproc, jobs, out_dir / f"launch{nproc}"))
    return results


def _between_jobs() -> None:
    """What a worker's closing destroy_parallel_state() does here: Megatron's groups go, the default group stays
    for the next job (a second rendezvous on torchrun's store is not needed)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()


def _main(spec: Path) -> None:
    import mega_async.trainer.parallel as par

    jobs = json.loads(spec.read_text())
    out = spec.parent
    rank = os.environ.get("RANK", "0")
    real = par.destroy_parallel_state
    par.destroy_parallel_state = _between_jobs  # the scripts import it by name when they run
    try:
        env = dict(os.environ)
        for name, (script, *args) in jobs.items():
            os.environ.clear()  # as launched: Megatron's configs write NVTE_* (attention backend) into it
            os.environ.update(env)
            path = HERE / script
            sys.argv = [str(path), *args]
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as e:
                if e.code not in (None, 0):
                    _fail(out, name, rank, f"{script} exited with {e.code}")
            except BaseException:  # noqa: BLE001 - the job's result, then the launch ends
                _fail(out, name, rank, traceback.format_exc())
            _between_jobs()
            if rank == "0":
                (out / f"{name}.done").touch()
    finally:
        par.destroy_parallel_state = real
    real()


def _fail(out: Path, name: str, rank: str, text: str) -> None:
    (out / f"{name}.rank{rank}.err").write_text(f"job {name} on rank {rank}:\n{text}")
    sys.stderr.write(text)
    sys.stderr.flush()
    os._exit(1)  # torchrun stops the other ranks


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
