"""`mega-async launch slurm -c CONFIG --nodes N --gpus-per-node G [--partition P] [--time T] [--requeue]
[--dry-run] [overrides]`: validate the split, render one sbatch job, print it (--dry-run) or submit it."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from mega_async.api.allocation import AllocationError
from mega_async.api.config import ConfigError, RunConfig, TrainerConfig
from mega_async.api.config_load import load_config
from mega_async.launch.slurm.plan import JobPlan, LaunchError, plan_job
from mega_async.launch.slurm.render import render_job

logger = logging.getLogger("mega_async.launch.slurm.submit")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mega-async launch slurm", description=__doc__,
                                epilog="every key of the run config (-c, overrides): mega-async train --help")
    p.add_argument("--config", "-c", required=True, help="YAML run config (see configs/)")
    p.add_argument("--nodes", type=int, default=None, help="nodes of the job (default: launch.nodes)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node (default: launch.gpus_per_node); CPU runs: trainer ranks + servers per node")
    p.add_argument("--partition", default=None)
    p.add_argument("--time", default=None, help="Slurm time limit, e.g. 04:00:00")
    p.add_argument("--requeue", action="store_true",
                   help="after pre-emption the job requeues itself and resumes (trainer.resume=auto)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the sbatch script; submit nothing")
    p.add_argument("overrides", nargs="*", help="dotted overrides, passed to the training run too")
    return p


def launch_parser() -> argparse.ArgumentParser:
    """`mega-async launch`: its subcommands, one per scheduler (their own flags in `mega-async launch slurm -h`)."""
    p = argparse.ArgumentParser(prog="mega-async launch", description="render and submit a training job to a "
                                "cluster scheduler (the job starts its inference servers and trainer ranks)")
    sub = p.add_subparsers(title="subcommands", metavar="{slurm}")
    sub.add_parser("slurm", help="validate the split, render one sbatch job, print it (--dry-run) or submit it "
                   "(mega-async launch slurm -h)")
    return p


def prepare(args: argparse.Namespace, workdir: Path) -> tuple[RunConfig, JobPlan, str]:
    """Config, plan and script text; raises ConfigError/LaunchError in one line when something does not fit."""
    cfg = load_config(args.config, args.overrides)
    launch = dataclasses.replace(cfg.launch, **{k: v for k, v in (("nodes", args.nodes),
                                 ("gpus_per_node", args.gpus_per_node), ("partition", args.partition),
                                 ("time", args.time)) if v is not None})
    cfg.launch = launch
    if launch.nodes is None or launch.gpus_per_node is None:
        raise LaunchError("how many nodes and GPUs: pass --nodes and --gpus-per-node (or set launch.nodes and "
                          "launch.gpus_per_node in the config)")
    if cfg.inference.backend == "simulated":
        raise LaunchError("inference.backend=simulated has no servers to train with; use embedded (CPU) or sglang")
    if cfg.inference.addresses:
        raise LaunchError("inference.addresses is set: the job starts its own servers; remove it")
    if args.requeue and "resume" not in {f.name for f in dataclasses.fields(TrainerConfig)}:
        raise LaunchError("--requeue resumes through trainer.resume, which this version does not have yet; "
                          "submit without --requeue (a pre-empted job then checkpoints and stops)")
    alloc = cfg.allocation()
    model = Path(cfg.model.path)
    if not (model / "config.json").exists():
        raise LaunchError(f"model.path={cfg.model.path} has no config.json; pass an HF model directory")
    from transformers import AutoConfig

    from mega_async.bridge.families import UnsupportedModelError, check_model

    hf = AutoConfig.from_pretrained(model)
    try:
        check_model(hf)  # what the trainer would refuse at start (e.g. MTP layers), refused before sbatch
    except UnsupportedModelError as e:
        raise LaunchError(str(e)) from None
    _check_weight_format(cfg, hf)
    plan = plan_job(alloc, launch.nodes, launch.gpus_per_node, backend=cfg.inference.backend, hf_config=hf,
                    dtype=cfg.model.dtype, gpu_memory_gib=launch.gpu_memory_gib,  # servers and trainer: model.dtype
                    router=cfg.inference.router == "smg", device=launch.device, trainer=cfg.trainer)
    train_args = ["-c", str(Path(args.config).resolve()), *args.overrides]
    script = render_job(plan, cfg, train_args, workdir=workdir, partition=launch.partition, time=launch.time,
                        requeue=args.requeue)
    return cfg, plan, script


def _check_weight_format(cfg: RunConfig, hf: object) -> None:
    """SGLang servers started on an FP8 block checkpoint load updates as FP8 blocks (and only those)."""
    from mega_async.launch.slurm.fit import fp8_block_size

    fp8 = fp8_block_size(hf) is not None
    fmt = cfg.trainer.sync_weight_format
    if fp8 and cfg.inference.backend == "sglang" and fmt != "fp8_block":
        raise LaunchError(f"model.path={cfg.model.path} is an FP8 block checkpoint: the SGLang servers started on it "
                          f"load FP8 weights with their weight_scale_inv, not {fmt}; set "
                          "trainer.sync_weight_format=fp8_block")
    if fmt == "fp8_block" and not fp8:
        raise LaunchError(f"trainer.sync_weight_format=fp8_block needs model.path={cfg.model.path} to be an FP8 block "
                          "checkpoint (config.json quantization_config: quant_method fp8, weight_block_size)")


def submit(cfg: RunConfig, script: str, workdir: Path) -> tuple[str, Path]:
    """Write `<run_dir>/slurm/job.sbatch` and sbatch it; returns (job id, script path)."""
    from mega_async.bridge.model_cards import ensure_weights, has_weights

    from mega_async.checkpoint.format import resume_point
    from mega_async.utils.diskspace import replaced
    from mega_async.run.lock import refuse_if_in_use

    run_dir = (workdir / cfg.run_dir).resolve()
    # the first run of the job starts under trainer.resume (requeued runs add trainer.resume=auto): a run
    # directory that already holds another run is refused here, before anything is submitted
    resume_point(run_dir, cfg.trainer.resume)
    refuse_if_in_use(run_dir)  # a live run owns it: refused before its job.sbatch is touched or a job queued
    if not has_weights(cfg.model.path):
        if cfg.inference.backend == "sglang":
            raise LaunchError(f"model.path={cfg.model.path} has a config but no weights: download the checkpoint "
                              "there (e.g. huggingface-cli download <repo> --local-dir <model.path>)")
        ensure_weights(cfg.model.path, seed=cfg.seed)  # the tiny CPU cards: what the driver would do
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
    path = run_dir / "slurm" / "job.sbatch"
    with replaced(path) as tmp:
        tmp.write_text(script)
    try:
        r = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, cwd=workdir,
                           timeout=120)
    except FileNotFoundError:
        raise LaunchError("sbatch not found: run this on a Slurm login node (or --dry-run to see the script)") from None
    if r.returncode != 0:
        raise LaunchError(f"sbatch refused the job: {(r.stderr or r.stdout).strip().splitlines()[-1:] or ['?']}"[:400])
    return r.stdout.strip().split(";")[0], path


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["slurm"]:
        top = launch_parser()
        if argv[:1] in (["-h"], ["--help"]):
            top.print_help()
            return 0
        top.print_usage(sys.stderr)
        what = f"unknown scheduler {argv[0]!r}" if argv else "name the scheduler"
        print(f"mega-async launch: {what}; the one there is: slurm (mega-async launch slurm -h)", file=sys.stderr)
        return 2
    from mega_async.checkpoint.format import CheckpointError
    from mega_async.run.lock import RunDirLockError

    args = parser().parse_args(argv[1:])
    workdir = Path.cwd()
    try:
        cfg, plan, script = prepare(args, workdir)
        if args.dry_run:
            print(script, end="")
            return 0
        job, path = submit(cfg, script, workdir)
    except (ConfigError, AllocationError, LaunchError, FileNotFoundError, CheckpointError, RunDirLockError) as e:
        print(f"mega-async launch slurm: {e}", file=sys.stderr)
        return 2
    run_dir = (workdir / cfg.run_dir).resolve()
    print("\n".join(plan.describe()))
    print(f"submitted job {job}: {path}\nlogs: {run_dir / 'logs'} (job.log: the job's own steps; driver.log: "
          f"the driver; server<i>.log; slurm-{job}.out)")
    return 0
