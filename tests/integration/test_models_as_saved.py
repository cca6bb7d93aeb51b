"""Checkpoints as users have them, through `mega-async convert` (one process, the trainer's own loader and export).

A DeepSeek-V3 saved by transformers carries num_nextn_predict_layers: 1 and none of the MTP layer's weights
(transformers has no module for it): it converts both ways without them, said in one warning, and the output's
config.json says 0. A checkpoint lacking any other tensor group its config.json asks for (the untied head, the
routers' expert bias, attention biases, shared experts) is refused in one line naming the tensor, its group and
the fix, never a KeyError. The trainer runs of such models are tests/integration/test_families_train.py's."""
import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from mega_async.bridge.model_cards import TINY_DEEPSEEK, TINY_GLM
from tests.checkpoints import transformers_saved
from tests.commands import ROOT, mega_async


def convert(*args: str) -> subprocess.Popen:
    return subprocess.Popen(mega_async("convert", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)


def test_a_transformers_saved_deepseek_v3_converts_without_its_mtp_layers(tmp_path):
    saved = transformers_saved(TINY_DEEPSEEK, tmp_path / "saved")
    assert json.loads((saved / "config.json").read_text())["num_nextn_predict_layers"] == 1
    p = convert("hf-to-mcore", "--hf", str(saved), "--out", str(tmp_path / "mc"))
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    warned = [x for x in err.splitlines() if "multi-token-prediction" in x]
    assert len(warned) == 1 and "carries none of their weights" in warned[0] and "trainer.mtp=init" in warned[0]
    p = convert("mcore-to-hf", "--mcore", str(tmp_path / "mc"), "--out", str(tmp_path / "hf"))
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    src, got = load_file(saved / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert got.keys() == src.keys() and all(torch.equal(got[k], src[k]) for k in src)


@pytest.mark.slow  # CI's second step: the default suite's budget (four refusals, each building a model)
def test_a_checkpoint_lacking_a_group_its_config_asks_for_is_refused_in_one_line(tmp_path):
    cases = {  # what is left out -> what the one line must say
        (TINY_DEEPSEEK, "lm_head.weight"): "'lm_head.weight', the output head: config.json says tie_word_embeddings: "
                                           "false; set it to true",
        (TINY_DEEPSEEK, "e_score_correction_bias"): "e_score_correction_bias', the routers' expert bias",
        (TINY_GLM, "self_attn.k_proj.bias"): "k_proj.bias', a bias that config.json's attention_bias: true",
        (TINY_GLM, "shared_experts.gate_proj.weight"): "shared_experts.gate_proj.weight', the shared experts that "
                                                       "config.json asks for",
    }
    runs = {}
    for i, ((card, drop), want) in enumerate(cases.items()):
        d = transformers_saved(card, tmp_path / f"m{i}", drop=[drop])
        runs[drop] = (want, d, convert("hf-to-mcore", "--hf", str(d), "--out", str(tmp_path / f"o{i}")))
    for drop, (want, d, p) in runs.items():
        _, err = p.communicate(timeout=600)
        last = err.strip().splitlines()[-1]
        assert p.returncode == 2 and last.startswith(f"convert: {d}: the checkpoint lacks '") and want in last, err[-2000:]
        assert "KeyError" not in err and "Traceback" not in err
        assert not (tmp_path / f"o{list(runs).index(drop)}").exists()  # nothing written
