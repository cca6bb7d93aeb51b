"""A model card with absurd sizes (issue 33 item 12): num_hidden_layers=10**6 built until memory ran out. The card's
parameter count is checked against the memory there is before anything is allocated, by every loader: the random
init, the embedded server, the trainer (and so the converter). One line naming the card and the numbers."""
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from mega_async.bridge.model_cards import (TINY_DEEPSEEK, TINY_GLM, TINY_MOE, ModelTooLarge, check_fits_memory,
                                    count_params, init_random_weights)

ABSURD = [{"num_hidden_layers": 10**6}, {"num_hidden_layers": 10**15}, {"hidden_size": 10**7},
          {"vocab_size": 10**12}, {"num_experts": 10**9, "num_local_experts": 10**9}]


def read_card(tmp_path: Path, base: Path = TINY_MOE, **fields) -> Path:
    out = tmp_path / "card"
    shutil.copytree(base, out, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config.update(fields)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _refusal(fn, card: Path, *expect: str) -> str:
    t = time.monotonic()
    with pytest.raises(ModelTooLarge) as e:
        fn()
    msg = str(e.value)
    assert time.monotonic() - t < 5 and "\n" not in msg and msg.startswith(f"{'--model ' if 'model' in expect else ''}")
    assert str(card) in msg and "of memory is available here; check the card's sizes" in msg, msg
    for x in expect:
        assert x in msg, msg
    return msg


@pytest.mark.parametrize("fields", ABSURD, ids=lambda f: ",".join(f"{k}={v:.0e}" for k, v in f.items()))
def test_an_absurd_card_is_refused_by_every_loader_before_it_allocates(tmp_path, fields):
    from mega_async.server.weights import load_pretrained
    from mega_async.trainer.model import build_model

    card = read_card(tmp_path, **fields)
    named = ", ".join(f"{k}={v}" for k, v in fields.items() if k != "num_local_experts")
    msg = _refusal(lambda: init_random_weights(card), card, named, "in float32 for its random init")
    assert not list(card.glob("*.safetensors"))
    (card / "model.safetensors").write_bytes(b"")  # a card with weights: the server and the trainer load it
    _refusal(lambda: load_pretrained(card, torch.bfloat16), card, named, "in bfloat16", "--model")
    _refusal(lambda: build_model(str(card), "megatron:d1"), card, named, "on this rank")
    assert "parameters (" in msg


def test_the_count_is_the_models_and_the_share_is_this_processs(tmp_path):
    """The count is what transformers builds (tiny cards of each family: parameters and the routers' bias); a rank's
    share divides dense weights by TP x PP and routed experts by EP x ETP x PP; a card that fits passes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for base in (TINY_MOE, TINY_DEEPSEEK, TINY_GLM):
        config = AutoConfig.from_pretrained(base)
        model = AutoModelForCausalLM.from_config(config)  # the checkpoint holds the routers' bias buffers too
        built = sum(p.numel() for p in model.parameters()) + sum(
            b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
        assert count_params(config).total == built, base
        assert check_fits_memory(base, str(base), dtype_bytes=4).total == built  # read raw, without transformers
    p = count_params(AutoConfig.from_pretrained(TINY_MOE))
    need = (p.dense // 2 + p.expert // 8) * 2
    assert check_fits_memory(TINY_MOE, "x", dtype_bytes=2, dense_shards=2, expert_shards=8, memory=need) == p
    share = rf"{need / 2**30:.1f} GiB \(this process's share: dense / 2, experts / 8\)"
    with pytest.raises(ModelTooLarge, match=rf"^x: the model card asks for {p.total:,} parameters .*{share}"):
        check_fits_memory(TINY_MOE, "x", dtype_bytes=2, dense_shards=2, expert_shards=8, memory=need - 1)
    assert check_fits_memory(tmp_path / "nothing-here", "x", dtype_bytes=4) is None  # the loader says what is wrong


@pytest.mark.parametrize("weights", [False, True])
def test_a_run_on_an_absurd_card_is_refused_at_start_up_in_one_line(tmp_path, capsys, weights):
    """Before anything starts (exit 2, no run directory): the random init the driver would write, or a trainer
    rank's share of a card that has weights."""
    from mega_async.cli import main

    card = read_card(tmp_path, num_hidden_layers=10**6)
    if weights:
        (card / "model.safetensors").write_bytes(b"")
    rc = main(["train", "-c", str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"),
               f"logging.root_dir={tmp_path / 'runs'}", f"model.path={card}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and f"model.path={card}: the model card asks for 62,112,131,136 parameters " \
           "(num_hidden_layers=1000000," in err, err
    assert ("on each trainer rank" if weights else "in float32 for its random init") in err, err
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # three interpreters importing transformers
def test_cards_initialised_at_once_by_several_processes_end_whole(tmp_path):
    """Three processes writing the same card's random init at the same moment (tests or runs starting together)
    all succeed and leave one whole file, the same bytes as a lone init, and no temporary folder (before: they
    shared `.tmp_save` and one removed the others' files mid-save)."""
    import subprocess
    import sys

    out, go = tmp_path / "card", tmp_path / "go"
    code = ("import os, sys, time; import transformers; from mega_async.bridge.model_cards import init_random_weights; "
            "print('ready', flush=True)\nwhile not os.path.exists(sys.argv[3]): time.sleep(0.005)\n"
            "init_random_weights(sys.argv[1], sys.argv[2], seed=0, force=True)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(TINY_MOE), str(out), str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    assert [p.stdout.readline().strip() for p in procs] == ["ready"] * 3  # all imported: they save at once
    go.touch()
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errs
    lone = init_random_weights(TINY_MOE, tmp_path / "lone", seed=0)
    assert (out / "model.safetensors").read_bytes() == (lone / "model.safetensors").read_bytes()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
