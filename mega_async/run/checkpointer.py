"""When a run saves and what it leaves: the checkpoint cadence (`trainer.save_interval`, `save_every_minutes`, the
last step), the pre-emption vote (any rank asked to stop: checkpoint, then Preempted), the resume (a checkpoint's
weights to the servers, its rollouts to the executor), the HF snapshots (`trainer.hf_snapshot_interval`) and the
final export (`<run_dir>/final_hf`)."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional

from mega_async.api.config import RunConfig
from mega_async.api.config_load import save_config
from mega_async.utils.comm import any_rank, from_rank0, rank
from mega_async.utils.diskspace import free_bytes

logger = logging.getLogger("mega_async.run.loop")


class Preempted(Exception):
    """The run stopped at a step boundary on request (Slurm's pre-emption signal) after writing a checkpoint."""

    def __init__(self, step: int, checkpoint: Any):
        super().__init__(f"preempted after step {step}; checkpoint {checkpoint}; continue with --resume"
                         if checkpoint is not None else f"preempted after step {step}; no checkpoint was written")
        self.step, self.checkpoint = step, checkpoint


class Checkpointer:
    """Every rank holds one; rank 0 (the head) also saves the rollout side."""

    def __init__(self, cfg: RunConfig, group: Any = None, stop_requested: Optional[Callable[[], bool]] = None):
        self.cfg, self.group, self.stop_requested = cfg, group, stop_requested
        self.engine: Any = None
        self.sync: Any = None
        self.head: Any = None
        self.start = 0
        self.preempted: Optional[Preempted] = None
        self._saved_at = time.monotonic()  # rank 0's clock at the start or the last checkpoint (save_every_minutes)
        self._save_s: Optional[float] = None  # how long this run's last checkpoint took to write
        self._last_path: Any = None

    def resume_point(self, rank0: bool, world: int, checked: bool) -> Optional[Path]:
        """The checkpoint to continue from (`trainer.resume`), on every rank. Rank 0 checks it whole first (unless
        the caller did: `checked`), then resets the run directory to it and saves the config."""
        from mega_async.checkpoint.format import checked_resume_point, reset_run_dir, resume_point
        from mega_async.utils.comm import from_rank0

        resume = None
        if rank0:
            resume = resume_point(self.cfg.run_dir, self.cfg.trainer.resume) if checked else \
                checked_resume_point(self.cfg, world)
            reset_run_dir(self.cfg.run_dir, resume)
            save_config(self.cfg, self.cfg.run_dir)
        return from_rank0(resume, self.group)

    @staticmethod
    def version_of(resume: Optional[Path]) -> Optional[int]:
        """The weight version a checkpoint was saved at (None: a fresh run)."""
        from mega_async.checkpoint.check import read_trainer_json

        return int(read_trainer_json(resume / "trainer.json")["version"]) if resume is not None else None

    def load(self, resume: Optional[Path], engine: Any) -> Optional[dict]:
        """The checkpoint's model and optimizer into the engine; its trainer.json (with `rollout` on rank 0)."""
        from mega_async.checkpoint.format import load_checkpoint

        self.engine = engine
        meta = load_checkpoint(resume, engine) if resume is not None else None
        self.start = meta["step"] + 1 if meta else 0
        return meta

    def resume(self, meta: Optional[dict], sync: Any, head: Any) -> None:
        """Before any rollout: the servers get the checkpoint's weights at its version (the sync's first push brings
        the version back to it), then the executor its saved rollouts."""
        self.sync, self.head = sync, head
        if meta:
            sync.push()
            if head is not None:
                head.restore(meta["rollout"], sync.version.value)

    def after_step(self, step: int) -> bool:
        """Save when due (cadence, last step, or any rank asked to stop); True: stop now (pre-empted)."""
        t = self.cfg.trainer
        stop = any_rank(bool(self.stop_requested and self.stop_requested()), self.group)
        last = step == t.total_steps - 1
        if t.hf_snapshot_interval and ((step + 1) % t.hf_snapshot_interval == 0 or last):
            self._snapshot(step)
        if stop and not last:
            skip = from_rank0(self._no_time_to_save(step) if rank() == 0 else None, self.group)
            if skip is not None:  # the checkpoint could not finish before the deadline: the last one stands
                logger.warning("%s", skip)
                self.preempted = Preempted(step, self._last_path)
                return stop
        if stop or last or (t.save_interval and (step + 1) % t.save_interval == 0) or self._clock_due():
            t0 = time.monotonic()
            path = self._save(step)
            self._saved_at = time.monotonic()
            self._save_s, self._last_path = self._saved_at - t0, path
            if stop:
                self.preempted = Preempted(step, path)
        return stop

    def _no_time_to_save(self, step: int) -> Optional[str]:
        """Rank 0, pre-empted: one line when a checkpoint would not finish before the warning's deadline
        (launch.preempt_signal_s after the signal came), judged by how long this run's last checkpoint took; None
        to write it (also when none was measured yet: nothing to judge by)."""
        if self._save_s is None:
            return None
        window = float(self.cfg.launch.preempt_signal_s)
        at = getattr(self.stop_requested, "at", None)
        left = window - (time.monotonic() - at) if at is not None else window
        need = 1.1 * self._save_s + 5.0
        if need <= left:
            return None
        return (f"pre-empted after step {step}: no checkpoint started, as the last one took {self._save_s:.0f}s and "
                f"{max(left, 0):.0f}s remain of the launch.preempt_signal_s={window:g}s warning; the run continues "
                f"from {self._last_path or 'the start (no checkpoint yet)'} (lower trainer.save_every_minutes, or "
                "raise launch.preempt_signal_s)")

    def _clock_due(self) -> bool:
        """trainer.save_every_minutes have passed since the start or the last checkpoint, by rank 0's clock (every
        rank hears its answer: the save is collective)."""
        minutes = self.cfg.trainer.save_every_minutes
        if not minutes:
            return False
        due = rank() == 0 and time.monotonic() - self._saved_at >= 60.0 * minutes
        return bool(from_rank0(due, self.group))

    def _snapshot(self, step: int) -> None:
        """The weights after `step` as an HF directory, `<run_dir>/hf_snapshots/step_<step>` (every rank takes part;
        written whole or not at all, so a resumed run's repeat of the step replaces it)."""
        from mega_async.trainer.weights import save_hf_checkpoint
        from mega_async.utils.diskspace import DiskFull, human, out_of_space

        t0 = time.monotonic()
        out = self.cfg.run_dir / "hf_snapshots" / f"step_{step}"
        short = from_rank0(self._snapshot_short(out) if rank() == 0 else None, self.group)
        if short is not None:  # skipped with a line, as every rank agrees: the run (and its checkpoints) go on
            logger.warning("HF snapshot %s skipped: %s", out.name, short)
            return
        try:
            save_hf_checkpoint(self.engine.models, out, src_dir=self.cfg.model.path, legacy=True)
        except Exception as e:
            if not out_of_space(e):
                raise
            raise DiskFull(f"HF snapshot {out} not written: no space left on device in {out.parent} "
                           f"({human(free_bytes(out.parent))} free); free space there, lower "
                           "trainer.hf_snapshot_keep, or set trainer.hf_snapshot_interval=0", out.parent) from None
        logger.info("HF snapshot %s (%.2fs)", out, time.monotonic() - t0)
        if rank() == 0 and self.cfg.trainer.hf_snapshot_keep:
            prune_snapshots(out.parent, self.cfg.trainer.hf_snapshot_keep)

    def _snapshot_short(self, out: Path) -> Optional[str]:
        """Rank 0: why an HF snapshot cannot fit (its size from the model card, against the free space), or None."""
        from mega_async.bridge.model_cards import read_card, count_params
        from mega_async.utils.diskspace import human

        try:
            need = count_params(read_card(self.cfg.model.path)).total * SNAPSHOT_DTYPE_BYTES[self.cfg.model.dtype]
        except Exception:  # noqa: BLE001 - a card the count does not know: no pre-check (the write still says)
            return None
        free = free_bytes(out.parent)
        old = out if out.exists() else None  # a resumed run's repeat of the step replaces its own snapshot
        if free is None or free + (dir_bytes(old) if old else 0) >= need * 1.05 + (16 << 20):
            return None
        return (f"it needs about {human(need)} and {human(free)} is free in {out.parent}; free space there, set "
                "trainer.hf_snapshot_keep, or trainer.hf_snapshot_interval=0")

    def export_final(self) -> None:
        """The run's final weights as an HF directory: `<run_dir>/final_hf` (every rank takes part)."""
        from mega_async.trainer.weights import save_hf_checkpoint

        save_hf_checkpoint(self.engine.models, self.cfg.run_dir / "final_hf", src_dir=self.cfg.model.path, legacy=True)

    def raise_if_preempted(self) -> None:
        if self.preempted is not None:
            raise self.preempted

    def _save(self, step: int) -> Any:
        from mega_async.checkpoint.format import save_checkpoint
        from mega_async.checkpoint.check import run_record

        t0 = time.monotonic()
        state, sizes = self.head.snapshot(self.sync) if self.head is not None else (None, {})
        path = save_checkpoint(self.cfg.run_dir, step, self.engine, self.sync.version.value,
                               self.cfg.parallel.allocation, state, keep=self.cfg.trainer.keep_checkpoints,
                               extra={**sizes, **run_record(self.cfg)})
        logger.info("checkpoint %s (%.1fs)", path, time.monotonic() - t0)
        return path


SNAPSHOT_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file() and not p.is_symlink())


def prune_snapshots(folder: Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` snapshots `step_<S>` of `folder` (only folders an HF export marked);
    returns those removed."""
    import re
    import shutil

    from mega_async.utils.outputs import marked

    steps = sorted((int(m[1]), p) for p in folder.iterdir()
                   if (m := re.fullmatch(r"step_(\d+)", p.name)) and p.is_dir() and not p.is_symlink()
                   and marked(p) == "hf")
    gone = [p for _, p in steps[:-keep]] if keep else []
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
