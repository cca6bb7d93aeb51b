"""An HF export (final_hf, a mid-run export, `mega-async convert mcore-to-hf`, the disk sync's versions) writes
through a partial folder of its own and swaps it in whole: a second export to the same output while the first is
mid-write leaves both finishing whole (before: both used `<out>.partial`, and the second's rmtree removed the
first's shard under it, so the first failed or swapped in a folder without its weights)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mega_async.bridge.model_cards import TINY_MOE, init_random_weights

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist" / "export_worker.py"


@pytest.mark.slow  # two processes building the card
def test_two_exports_to_one_output_each_finish_whole(tmp_path):
    hf = init_random_weights(TINY_MOE, tmp_path / "hf", seed=5)
    out, signals = tmp_path / "out", tmp_path / "signals"
    signals.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def start(name: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(WORKER), "--model", str(hf), "--out", str(out),
                                 "--signals", str(signals), "--name", name, *extra], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    # a: holds after its first shard until b has finished; b starts once a has written that shard
    a = start("a", "--hold-until", "b.done")
    b = start("b", "--wait-for", "a.wrote")
    outs = {name: p.communicate(timeout=600)[0] for name, p in (("a", a), ("b", b))}
    assert (a.returncode, b.returncode) == (0, 0), outs
    src = load_file(str(hf / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == src.keys() and all(torch.equal(got[k], src[k]) for k in src)
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out", "signals"]  # no partial or old folder left
