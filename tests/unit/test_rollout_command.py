"""`mega-async rollout` (the rollout layer alone) on the simulated backend runs its steps and ends cleanly."""
from __future__ import annotations

import json

from mega_async.cli import main


def test_rollout_on_the_simulated_backend_ends_cleanly(tmp_path):
    # before the fix InferenceService.close() read a supervisor the simulated branch never set (AttributeError
    # after the last step, exit 1)
    rc = main(["rollout", "inference.backend=simulated", "trainer.total_steps=2", f"logging.root_dir={tmp_path}",
               "logging.tensorboard=false", "trial_name=sim"])
    assert rc in (0, None)
    lines = [json.loads(x) for x in next(tmp_path.glob("*/sim/metrics.jsonl")).read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1]
    assert all(x["groups"] > 0 for x in lines)
