"""`mega-async` command line: rollout (driver without a trainer yet), serve (embedded inference server)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from mega_async.api.config import ConfigError
from mega_async.api.config_load import load_config


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def _cmd_rollout(args: argparse.Namespace) -> int:
    from mega_async.run.loop import run_rollout

    cfg = load_config(args.config, args.overrides)
    _setup_logging(cfg.logging.level)
    if (lock := _hold_run_dir("rollout", cfg.run_dir)) is None:
        return 2
    with lock:
        history = run_rollout(cfg)
    last = history[-1]
    tokens = sum(h["output_tokens"] for h in history)
    print(
        f"rollout done: {len(history)} steps, {sum(h['sequences'] for h in history)} sequences, {tokens} tokens "
        f"in {last['elapsed_s']:.1f}s; max head staleness {max(h['head_staleness_max'] for h in history)} "
        f"(rollout.max_staleness={cfg.rollout.max_staleness}); run dir {cfg.run_dir}"
    )
    return 0


def _hold_run_dir(command: str, run_dir: Path) -> Any:
    """The run directory's lock (mega_async.run.lock) for `mega-async <command>`; None after a one-line refusal."""
    from mega_async.run.lock import RunDirLock, RunDirLockError

    try:
        return RunDirLock.acquire(run_dir)
    except RunDirLockError as e:
        print(f"mega-async {command}: {e}", file=sys.stderr)
        return None


def _cmd_init_weights(argv: list[str]) -> int:
    from mega_async.bridge.model_cards import init_random_weights

    p = argparse.ArgumentParser(prog="mega-async init-weights", description="random-init safetensors for a model card")
    p.add_argument("model_dir", help="directory with config.json (e.g. models/tiny-qwen3-moe)")
    p.add_argument("--out", default=None, help="write here instead of in place (config and tokenizer are copied)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite existing weights")
    a = p.parse_args(argv)
    out = init_random_weights(a.model_dir, a.out, seed=a.seed, force=a.force)
    print(f"weights in {out}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from mega_async.utils import lifeline
    from mega_async.launch import local

    if local.under_launcher():  # a rank: it ends with the command or agent that started it, however they end
        lifeline.watch_launcher()
    if args.resume:
        args.overrides = [o for o in args.overrides if not o.startswith("trainer.resume=")] + ["trainer.resume=require"]
    cfg = load_config(args.config, args.overrides)
    if cfg.inference.backend == "simulated":
        raise ConfigError("inference.backend=simulated has no model to train or update; mega-async train needs "
                          "embedded or sglang servers (the simulator is for mega-async rollout)")
    layout = cfg.allocation().train
    if (Path(cfg.model.path) / "config.json").exists():  # a layout that does not fit fails before anything starts
        from transformers import AutoConfig

        from mega_async.api.allocation import validate_for_model

        validate_for_model(layout, AutoConfig.from_pretrained(cfg.model.path))
    from mega_async.checkpoint.format import resume_point
    from mega_async.run.lock import RunDirLockError
    from mega_async.run.loop import check_inputs

    owner = _owns_run_dir(cfg)
    lock = None
    try:
        try:
            if owner and cfg.run_dir.exists():  # another live run here: refused before anything is read or written
                lock = _lock_run_dir(cfg)
            found = resume_point(cfg.run_dir, cfg.trainer.resume)  # no mix of two runs, no link out of the run dir
            check_inputs(cfg)  # model card, context budget, dataset and reward before any rank or server starts
            if owner and lock is None:
                lock = _lock_run_dir(cfg)
        except RunDirLockError as e:
            print(f"mega-async train: {e}", file=sys.stderr)
            return 2
        if (done := _finished(cfg, found)) is not None:
            print(f"mega-async train: {done}")
            return 0
        rc = _train(args, cfg, layout.world_size, lock)
    finally:
        if lock is not None:
            lock.release()
    _exit_now_if_abandoned(rc)
    return rc


def _exit_now_if_abandoned(rc: int) -> None:
    """After a weight broadcast was abandoned (its receivers never joined), end the process here, everything else
    closed (servers, run lock, logs): a normal exit would wait in the gloo group's destructor for that broadcast
    until trainer.sync_timeout (294-299 s at the default, measured before this)."""
    dist_sync = sys.modules.get("mega_async.trainer.sync.distributed")
    if dist_sync is None or not dist_sync.broadcasts_abandoned():
        return
    import contextlib

    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
    os._exit(rc)


def _owns_run_dir(cfg: Any) -> bool:
    """Whether this process locks the run directory: the driver, i.e. `mega-async train` itself, or rank 0 under an
    external torchrun/srun unless what started it holds the lock for it (the local launcher, the Slurm job)."""
    import os

    from mega_async.launch import local

    if not local.under_launcher():
        return True
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    held = os.environ.get(local.RUN_LOCK_ENV)
    return rank == 0 and not (held and Path(held).resolve() == Path(cfg.run_dir).resolve())


def _lock_run_dir(cfg: Any) -> Any:
    """The driver's RunDirLock (mega_async.run.lock); None when the Slurm job running this driver holds it."""
    import os

    from mega_async.run.lock import RunDirInUse, RunDirLock, holder

    try:
        return RunDirLock.acquire(cfg.run_dir)
    except RunDirInUse:
        job = os.environ.get("SLURM_JOB_ID")
        if job and holder(cfg.run_dir).get("slurm_job") == job:  # launch/slurm/lib.sh locked it for this job
            return None
        raise


def _finished(cfg: Any, found: Optional[Path]) -> Optional[str]:
    """One line when resuming a run whose last step and final export are done (None: there is work)."""
    from mega_async.checkpoint.format import CheckpointError
    from mega_async.checkpoint.check import read_trainer_json

    if found is None or not (cfg.run_dir / "final_hf").is_dir():
        return None
    try:
        step = read_trainer_json(found / "trainer.json")["step"]
    except CheckpointError:
        return None  # the whole check before the run says what is wrong with it
    if step + 1 < cfg.trainer.total_steps:
        return None
    return (f"nothing to do: {cfg.run_dir} already finished {step + 1} steps (trainer.total_steps="
            f"{cfg.trainer.total_steps}; final weights in {cfg.run_dir / 'final_hf'}); to train on, pass a larger "
            "trainer.total_steps with --resume, or start a new run with another trial_name")


def _resume_hint(run_dir: Path) -> str:
    from mega_async.checkpoint.format import latest_checkpoint

    last = latest_checkpoint(run_dir)
    how = ("submit the job again with trainer.resume=auto (mega-async launch slurm ... trainer.resume=auto)"
           if os.environ.get("SLURM_JOB_ID") else "--resume")
    return (f"; last checkpoint {last.name}: continue with {how}" if last is not None else
            "; no checkpoint was written yet (trainer.save_interval)")


def _train(args: argparse.Namespace, cfg: Any, world: int, lock: Any) -> int:
    """Start the ranks (one host, several ranks) or be one; the run's end in one line."""
    import contextlib
    import os

    from mega_async.checkpoint.format import CheckpointError, checked_resume_point
    from mega_async.launch import local
    from mega_async.run.console import setup_logging

    setup_logging(cfg.logging.level, cfg.run_dir, cfg.trainer.total_steps, verbose=args.verbose)
    checked = not local.under_launcher()  # under torchrun/srun every rank runs this: rank 0 checks in run_training
    if checked:  # the checkpoint checked whole (logged) before any rank or server starts
        checked_resume_point(cfg, world)
    if world > 1 and not local.under_launcher():  # one host: start the trainer ranks ourselves
        argv = ["train"] + (["-c", args.config] if args.config else []) + (["-v"] if args.verbose else []) \
            + list(args.overrides)
        return local.launch_local(world, argv, run_lock=lock, resume_hint=lambda: _resume_hint(cfg.run_dir))
    from mega_async.api.allocation import AllocationError
    from mega_async.run.loop import Preempted, run_training

    local.stop_on_sigterm()
    try:
        history = run_training(cfg, stop_requested=local.PreemptFlag(), resume_checked=checked)
    except Preempted as e:  # a clean stop with a checkpoint: exit 0 so a requeued job resumes
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"mega-async train: {e}", flush=True)
        return 0
    except BaseException as e:
        if isinstance(e, (ConfigError, AllocationError, FileNotFoundError, CheckpointError)) and world == 1:
            raise  # bad input: main() prints it in one line
        logging.getLogger("mega_async.cli").exception("trainer rank failed")
        if world > 1:  # leave at once: a collective teardown could wait on a dead rank
            if local.stopped_by_launcher(e):  # torchrun stopping us is not the failure to report, a signal may be
                local.record_stop(e)
            else:
                line = local.record_error(e)
                if not os.environ.get(local.ERROR_DIR_ENV):  # under an external torchrun/srun: say it here
                    print(f"mega-async train: {line}", file=sys.stderr, flush=True)
            logging.shutdown()
            os._exit(1)
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            if isinstance(e, KeyboardInterrupt):
                print(f"mega-async train: interrupted{_resume_hint(cfg.run_dir)}", file=sys.stderr)
                return 130
            if local.stopped_by_launcher(e):
                print(f"mega-async train: {e}{_resume_hint(cfg.run_dir)}", file=sys.stderr)
                return e.code
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            print(f"mega-async train: {type(e).__name__}: {first}", file=sys.stderr)
        return 1
    if history:
        first, last = history[0], history[-1]
        print(f"training done: {len(history)} steps in {last['elapsed_s']:.1f}s; reward {first['reward_mean']:.3f} -> "
              f"{last['reward_mean']:.3f}; weights version {last['version']} on the servers; final weights in "
              f"{cfg.run_dir / 'final_hf'}")
        _report(cfg.run_dir)
    elif int(os.environ.get("RANK", "0")) == 0:  # resumed after the last step: only the final export was left
        print(f"mega-async train: no step left to train (trainer.total_steps={cfg.trainer.total_steps}); final "
              f"weights written to {cfg.run_dir / 'final_hf'}")
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    from mega_async.run.console import setup_logging
    from mega_async.api.sft_config import load_sft_config
    from mega_async.run.sft import run_sft

    cfg = load_sft_config(args.config, args.overrides)
    if (lock := _hold_run_dir("sft", cfg.run_dir)) is None:
        return 2
    setup_logging(cfg.logging.level, cfg.run_dir, verbose=args.verbose)
    with lock:
        r = run_sft(cfg)
    print(f"sft done: {r['steps']} steps in {r['train_s']:.0f}s; held-out exact match greedy {r['greedy']:.3f}, "
          f"sampled (t=1) {r['sampled_t1']:.3f} over {r['problems']} problems; weights in {cfg.run_dir / 'final_hf'}")
    return 0


def _report(run_dir: Path) -> None:
    """End-of-run report: report.png next to metrics.jsonl and the summary table (never fails the run)."""
    from mega_async.run.report import write_report

    try:
        png, table = write_report(run_dir)
    except Exception as e:  # noqa: BLE001 - a finished run stays finished
        logging.getLogger("mega_async.cli").warning("end-of-run report failed: %s: %s", type(e).__name__, e)
        return
    print(f"{table}\nreport: {png}; full log: {run_dir / 'train.log'}")


class _Parser(argparse.ArgumentParser):
    """A subcommand parser whose --help ends with every key of its typed config (`schema`: a function returning
    the dataclass, imported only when help is asked), generated by config.describe_config so it cannot drift."""

    def __init__(self, *args: Any, schema: Optional[Callable[[], type]] = None, **kwargs: Any):
        super().__init__(*args, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
        self._schema = schema

    def format_help(self) -> str:
        if self._schema is not None and self.epilog is None:
            from mega_async.api.config_load import describe_config

            self.epilog = describe_config(self._schema())
        return super().format_help()


def _run_schema() -> type:
    from mega_async.api.config import RunConfig

    return RunConfig


def _sft_schema() -> type:
    from mega_async.api.sft_config import SFTConfig

    return SFTConfig


def main(argv: list[str] | None = None) -> int:
    from mega_async import __version__

    parser = argparse.ArgumentParser(prog="mega-async", description="asynchronous RL post-training of MoE models "
                                     "(Megatron-Core trainer, SGLang-protocol servers); mega-async COMMAND --help "
                                     "for each command (train --help lists every setting)")
    parser.add_argument("--version", action="version", version=f"mega-async {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("rollout", help="run the asynchronous rollout layer for trainer.total_steps steps",
                       schema=_run_schema)
    p.add_argument("--config", "-c", default=None, help="YAML run config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.max_staleness=4")
    p.set_defaults(fn=_cmd_rollout)
    t = sub.add_parser("train", help="asynchronous RL training: rollout on inference servers, Megatron trainer",
                       schema=_run_schema)
    t.add_argument("--config", "-c", default=None, help="YAML run config (see configs/)")
    t.add_argument("--verbose", "-v", action="store_true", help="third-party INFO and warnings on the console too")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=5")
    t.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in the run directory (trainer.resume=require)")
    t.set_defaults(fn=_cmd_train)
    f = sub.add_parser("sft", help="supervised fine-tuning on the addition task through the Megatron engine",
                       schema=_sft_schema)
    f.add_argument("--config", "-c", default=None, help="SFT YAML (configs/addition_sft_cpu.yaml)")
    f.add_argument("--verbose", "-v", action="store_true", help="third-party INFO and warnings on the console too")
    f.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=200")
    f.set_defaults(fn=_cmd_sft)
    sub.add_parser("serve", help="embedded SGLang-protocol server (see python -m mega_async.server -h)",
                   add_help=False)
    sub.add_parser("init-weights", help="write deterministic random-init weights for a model card",
                   add_help=False)
    sub.add_parser("convert", help="HF <-> Megatron checkpoints (see mega-async convert -h)", add_help=False)
    sub.add_parser("launch", help="render and submit a Slurm job (see mega-async launch -h)", add_help=False)
    sub.add_parser("bench", help="nightly throughput benchmark with a regression gate (see mega-async bench -h)",
                   add_help=False)
    sub.add_parser("pin", help="run a mega-async command with the servers and the trainer on disjoint CPU halves "
                   "(see mega-async pin -h)", add_help=False)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["pin"]:
        from mega_async.launch.pinning import main as pin

        return pin(argv[1:], run=main)
    if argv[:1] == ["bench"]:
        from mega_async.bench.scenarios import main as bench

        return bench(argv[1:])
    if argv[:1] == ["launch"]:
        from mega_async.launch.slurm.submit import main as launch

        return launch(argv[1:])
    if argv[:1] == ["convert"]:
        from mega_async.checkpoint.convert import main as convert

        return convert(argv[1:])
    if argv[:1] == ["serve"]:
        from mega_async.server import main as serve

        serve(argv[1:])
        return 0
    if argv[:1] == ["init-weights"]:
        try:
            return _cmd_init_weights(argv[1:])
        except FileNotFoundError as e:
            print(f"mega-async init-weights: {e}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    from mega_async.api.allocation import AllocationError
    from mega_async.checkpoint.format import CheckpointError

    try:
        return args.fn(args)
    except (ConfigError, AllocationError, FileNotFoundError, CheckpointError) as e:  # bad input: one line
        kind = "CheckpointError: " if isinstance(e, CheckpointError) else ""
        print(f"mega-async {args.command}: {kind}{e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
