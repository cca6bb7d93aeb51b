"""`--resume` (or trainer.resume=auto) of a run whose last step and final export are done says so in one line,
with how to go on, and starts nothing."""
import json
from pathlib import Path

import pytest

from mega_async.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


def _finished_run(run: Path, step: int) -> None:
    """What a finished 3-step run leaves that a resume reads first: its last checkpoint's trainer.json, final_hf."""
    ckpt = run / "checkpoints" / f"step_{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text(json.dumps({
        "step": step, "version": step + 1, "allocation": "sglang:d1+megatron:d1", "world_size": 1, "optimizers": 1,
        "scheduler": {"max_lr": 0.01, "min_lr": 0.0, "lr_warmup_steps": 2, "lr_decay_steps": 3,
                      "lr_decay_style": "constant", "num_steps": step + 1}}))
    (run / "final_hf").mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(step + 1)))


@pytest.mark.parametrize("how", [["--resume"], ["trainer.resume=auto"]])
def test_resuming_a_finished_run_says_there_is_nothing_to_do(tmp_path, capsys, how):
    run = tmp_path / "runs" / "tiny_cpu" / "run0"
    _finished_run(run, 2)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    rc = main(["train", "-c", TINY, f"logging.root_dir={tmp_path / 'runs'}", "trainer.total_steps=3", *how])
    out, err = capsys.readouterr()
    assert rc == 0 and err == "" and out.count("\n") == 1, (out, err)
    assert out.startswith(f"mega-async train: nothing to do: {run} already finished 3 steps (trainer.total_steps=3;")
    assert "pass a larger trainer.total_steps with --resume, or start a new run with another trial_name" in out
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.name != "run.lock"} == before  # nothing touched
