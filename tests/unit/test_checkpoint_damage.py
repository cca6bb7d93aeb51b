"""Resuming a damaged or foreign run directory (issue 24's table, one test per row): each is refused before
anything starts with one line `<path>: <what>; <fix>`, or, for a changed batch size or synthetic target,
continued only under trainer.resume_override with a log line saying what changed. The manifest finds damage
anywhere at once; a checkpoint re-sealed after the damage (a colleague's run, a file damaged before it was
written) is still refused by the checks behind it."""
import json
import logging
import math
import os
import pickle
import shutil

import pytest
import torch

from mega_async.checkpoint.format import CheckpointError, checked_resume_point, latest_checkpoint
from mega_async.checkpoint.check import MANIFEST, validate_checkpoint, verify_manifest, write_manifest
from mega_async.api.config_load import load_config
from mega_async.utils.safe_load import dist_load
from tests.unit.checkpoint_builder import (EXTRA, TINY, WEIGHT, one_rank_group, rollout_state, save_model_dir,
                                           sharded_state_dict, write_run_checkpoint)


@pytest.fixture(scope="module")
def group():
    with one_rank_group():
        yield


@pytest.fixture(scope="module")
def model_src(group, tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("dcp") / "model")


def config(tmp_path, *overrides):
    return load_config(TINY, [f"logging.root_dir={tmp_path / 'runs'}", "trainer.resume=require",
                              "rollout.consumer_batch_size=4", *overrides])


@pytest.fixture()
def run(tmp_path, model_src):
    cfg = config(tmp_path)
    return cfg, write_run_checkpoint(cfg, model_src)


def refused(cfg, pattern, world=1):
    with pytest.raises(CheckpointError) as e:
        checked_resume_point(cfg, world)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 600, msg
    assert __import__("re").search(pattern, msg), msg
    return msg


def edit_json(path, **fields):
    meta = json.loads(path.read_text())
    meta.update(fields)
    path.write_text(json.dumps(meta))


def truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def test_an_intact_checkpoint_passes_and_is_sealed(run):
    cfg, ck = run
    assert checked_resume_point(cfg, 1) == ck and verify_manifest(ck)
    files = json.loads((ck / MANIFEST).read_text())["files"]
    assert {"trainer.json", "rollout.pt", "rng/rank0.pt", "model/.metadata", "model/common.pt"} <= set(files)


# ---- trainer.json ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reseal", [False, True], ids=["manifest", "resealed"])
@pytest.mark.parametrize("fields, pattern", [
    ({"version": "3"}, r"trainer\.json: version='3' must be an integer >= 0"),  # a string where a number belongs
    ({"metrics_bytes": 10 ** 30}, r"trainer\.json: metrics_bytes=10{30} must be an integer"),  # huge sizes
    ({"ledger_bytes": 10 ** 12}, r"rollouts\.jsonl: \d+ bytes, the checkpoint saw 1000000000000"),
    ({"step": -1}, r"trainer\.json: step=-1 must be an integer >= 0"),  # a negative step
    ({"step": 5}, r"trainer\.json: step 5, but the folder is step_00000002"),
    ({"scheduler": {"num_steps": "x"}}, r"trainer\.json: scheduler must hold numbers"),
], ids=["string", "huge", "size-beyond-file", "negative-step", "other-step", "scheduler"])
def test_trainer_json_with_wrong_fields(run, fields, pattern, reseal):
    cfg, ck = run
    edit_json(ck / "trainer.json", **fields)
    if reseal:
        write_manifest(ck)
        refused(cfg, pattern)
    else:
        refused(cfg, r"trainer\.json: its sha256 differs from manifest\.json|trainer\.json: \d+ bytes, manifest")


def test_a_log_shorter_than_the_checkpoint_saw_is_refused_a_missing_one_is_not(run, caplog):
    cfg, ck = run
    truncate(cfg.run_dir / "metrics.jsonl")
    refused(cfg, r"metrics\.jsonl: \d+ bytes, the checkpoint saw \d+ \(metrics_bytes in .*trainer\.json\).*move it "
                 "away to resume without its old lines")
    (cfg.run_dir / "metrics.jsonl").unlink()
    with caplog.at_level(logging.WARNING, logger="mega_async.checkpoint.format"):
        assert checked_resume_point(cfg, 1) == ck
    assert "metrics.jsonl is missing (the checkpoint saw" in caplog.text


def test_trainer_json_truncated(run):
    cfg, ck = run
    truncate(ck / "trainer.json")
    refused(cfg, r"step_00000002/trainer\.json: \d+ bytes, manifest\.json says \d+ .*; restore it from")
    write_manifest(ck)
    refused(cfg, r"trainer\.json: not valid JSON \(.*\): truncated or damaged; restore it")


# ---- torch files ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rel", ["rollout.pt", "model/common.pt", "rng/rank0.pt"])
def test_truncated_torch_files(run, rel):
    cfg, ck = run
    truncate(ck / rel)
    refused(cfg, rf"{rel}: \d+ bytes, manifest\.json says \d+ \(truncated")
    write_manifest(ck)
    refused(cfg, rf"{rel}: not a readable torch file \(.*\); the file is truncated or damaged")


def test_rng_state_of_something_else(run):
    cfg, ck = run
    torch.save({"python": [3, [1, 2], None], "torch": torch.zeros(4, dtype=torch.uint8)}, ck / "rng" / "rank0.pt")
    write_manifest(ck)
    refused(cfg, r"rng/rank0\.pt: not an RNG state \(")


def test_deeply_nested_json_is_refused_in_one_line(run):
    cfg, ck = run
    (ck / "trainer.json").write_text("[" * 100000 + "]" * 100000)
    write_manifest(ck)
    refused(cfg, r"trainer\.json: not valid JSON")


def test_rollout_pt_of_something_else(run):
    cfg, ck = run
    torch.save({"x": 1}, ck / "rollout.pt")
    write_manifest(ck)
    refused(cfg, r"rollout\.pt: not the rollout state of a run")
    state = rollout_state(cfg.seed)
    state["executor"]["episodes"][0].update(state="running", journal=[{"input_ids": [1, 2]}])  # a cut journal
    torch.save(state, ck / "rollout.pt")
    write_manifest(ck)
    refused(cfg, r"rollout\.pt: not the rollout state of a run")


def test_rollout_pt_replaced_by_a_link_to_a_system_file(run):
    cfg, ck = run
    (ck / "rollout.pt").unlink()
    os.symlink("/etc/passwd", ck / "rollout.pt")
    refused(cfg, r"rollout\.pt: is a symbolic link \(to /etc/passwd\).*replace the link")


# ---- the distributed checkpoint -------------------------------------------------------------------------
def test_distcp_missing(run):
    cfg, ck = run
    (ck / "model" / "__0_0.distcp").unlink()
    refused(cfg, r"model/__0_0\.distcp: missing \(listed in manifest\.json\)")
    (ck / MANIFEST).unlink()  # an old checkpoint: found by the metadata's entries
    refused(cfg, r"model/__0_0\.distcp: missing; the checkpoint is incomplete")


def test_distcp_truncated(run):
    cfg, ck = run
    truncate(ck / "model" / "__0_0.distcp", 0.9)
    refused(cfg, r"__0_0\.distcp: \d+ bytes, manifest\.json says \d+")
    (ck / MANIFEST).unlink()
    refused(cfg, r"__0_0\.distcp: \d+ bytes, but .* is stored at \d+\+\d+ \(\.metadata\): the file is truncated")


def test_distcp_changed_in_place(run):
    cfg, ck = run
    f = ck / "model" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    refused(cfg, r"__0_0\.distcp: its sha256 differs from manifest\.json")


def nan_model(src, dst):
    with torch.no_grad():
        w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        w[1, 2] = math.nan
    return save_model_dir(dst, w)


def test_distcp_with_nan_weights_is_refused_at_load(run, tmp_path, model_src):
    cfg, ck = run
    shutil.rmtree(ck / "model")
    nan_model(model_src, ck / "model")
    write_manifest(ck)  # the run that wrote it diverged: the files are as written
    validate_checkpoint(ck, cfg, 1)
    with pytest.raises(CheckpointError, match=rf"model/__0_0\.distcp: {WEIGHT} holds NaN or inf values"):
        dist_load(sharded_state_dict(torch.zeros(3, 4)), ck / "model")


def test_checkpoint_of_another_model(run, tmp_path):
    cfg, ck = run
    card = tmp_path / "other-card"
    shutil.copytree(cfg.model.path, card, ignore=shutil.ignore_patterns("*.safetensors"))
    edit_json(card / "config.json", hidden_size=json.loads((card / "config.json").read_text())["hidden_size"] * 2)
    other = config(tmp_path, f"model.path={card}")
    refused(other, r"trainer\.json: the checkpoint is of another model \(hidden_size=\d+, model\.path=.* has \d+\); "
                   r"resume with the model card")
    # a checkpoint that predates the record: the shapes differ when it is read, before anything runs
    with pytest.raises(CheckpointError, match=r"model: .*Global shape mismatch .* another model .*model\.path"):
        dist_load(sharded_state_dict(torch.zeros(3, 8)), ck / "model")


# ---- the rest of the checkpoint and the run directory -----------------------------------------------------
def test_rng_folder_missing(run):
    cfg, ck = run
    shutil.rmtree(ck / "rng")
    refused(cfg, r"rng/rank0\.pt: missing \(listed in manifest\.json\)")
    write_manifest(ck)
    refused(cfg, r"rng/rank0\.pt: missing \(the RNG state of trainer rank 0")
    validate_checkpoint(ck, cfg, 2)  # another rank count: the RNG starts fresh by design (logged at load)


def test_checkpoint_folder_linked_out_of_the_run_dir(run, tmp_path):
    cfg, ck = run
    elsewhere = tmp_path / "elsewhere"
    shutil.move(ck, elsewhere)
    os.symlink(elsewhere, ck)
    refused(cfg, r"step_00000002: is a symbolic link \(to .*elsewhere\)")
    os.unlink(ck)
    shutil.move(elsewhere, ck)
    root = ck.parent
    shutil.move(root, tmp_path / "ckpts")
    os.symlink(tmp_path / "ckpts", root)
    refused(cfg, r"checkpoints: is a symbolic link")


def test_metrics_linked_out_of_the_run_dir_is_neither_followed_nor_truncated(run, tmp_path):
    cfg, ck = run
    outside = tmp_path / "precious.txt"
    outside.write_text("x" * 1000)
    (cfg.run_dir / "metrics.jsonl").unlink()
    os.symlink(outside, cfg.run_dir / "metrics.jsonl")
    refused(cfg, r"metrics\.jsonl: is a symbolic link")
    from mega_async.checkpoint.format import resume_point

    with pytest.raises(CheckpointError, match="symbolic link"):
        resume_point(cfg.run_dir, "auto")  # a fresh start (no checkpoint) would truncate it too
    assert outside.read_text() == "x" * 1000


def test_a_hard_linked_log_is_refused(run, tmp_path):
    cfg, _ = run
    outside = tmp_path / "other.jsonl"
    outside.write_text("keep\n")
    (cfg.run_dir / "events.jsonl").unlink()
    os.link(outside, cfg.run_dir / "events.jsonl")
    refused(cfg, r"events\.jsonl: has 2 hard links")


def test_a_file_the_manifest_does_not_list(run):
    cfg, ck = run
    (ck / "model" / "extra.pt").write_bytes(b"x")
    refused(cfg, r"model/extra\.pt: not in manifest\.json .*remove it")


@pytest.mark.parametrize("key, value", [("rollout.consumer_batch_size", 8), ("data.synthetic_target", 9)])
def test_a_changed_batch_size_or_target_needs_an_override(run, tmp_path, caplog, key, value):
    cfg, ck = run
    changed = config(tmp_path, f"{key}={value}")
    then = 4 if key == "rollout.consumer_batch_size" else 7
    refused(changed, rf"trainer\.json: the checkpoint's run had {key}={then}, this config has {value}; resume with "
                     rf"{key}={then}, or pass trainer.resume_override=\[{key}\]")
    ok = config(tmp_path, f"{key}={value}", f"trainer.resume_override=[{key}]")
    with caplog.at_level(logging.WARNING, logger="mega_async.checkpoint.format"):
        assert checked_resume_point(ok, 1) == ck
    assert f"with {key}={value} (the checkpoint's run had {then})" in caplog.text


def test_a_changed_group_size_or_seed_is_refused_even_with_an_override(run, tmp_path):
    refused(config(tmp_path, "rollout.group_size=2"), r"rollout\.group_size=4, this config has 2; resume with "
                                                      r"rollout\.group_size=4 or start a fresh run")
    refused(config(tmp_path, "seed=5", "trainer.resume_override=[rollout.consumer_batch_size]"), r"seed=1, this config "
                                                                                                 "has 5")


def test_an_old_checkpoint_without_a_manifest_is_checked_and_accepted_with_a_warning(run, caplog):
    cfg, ck = run
    (ck / MANIFEST).unlink()
    meta = json.loads((ck / "trainer.json").read_text())
    del meta["run"], meta["model_config"]
    (ck / "trainer.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="mega_async.checkpoint.format"):
        assert checked_resume_point(cfg, 1) == ck
    assert "has no manifest.json" in caplog.text and "has no record of its run" in caplog.text
    edit_json(ck / "trainer.json", version="3")  # everything but the checksums is still checked
    refused(cfg, r"version='3' must be an integer")


def test_the_cli_prints_one_line_and_starts_nothing(run, capsys):
    from mega_async.cli import main

    cfg, ck = run
    truncate(ck / "rollout.pt")
    rc = main(["train", "-c", str(TINY), f"logging.root_dir={cfg.logging.root_dir}", "rollout.consumer_batch_size=4",
               "--resume"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert err.startswith(f"mega-async train: CheckpointError: {ck / 'rollout.pt'}: ") and "manifest.json says" in err
    log = cfg.run_dir / "train.log"
    assert not (cfg.run_dir / "weights").exists() and (not log.exists() or "starting server" not in log.read_text())


def test_metadata_object_entry_pointing_outside_is_refused(run):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    cfg, ck = run
    meta = pickle.loads((ck / "model" / ".metadata").read_bytes())
    idx = next(i for i in meta.storage_data if i.fqn.startswith(EXTRA))
    meta.storage_data[idx].relative_path = "../../../../../../etc/passwd"
    assert isinstance(idx, MetadataIndex)
    (ck / "model" / ".metadata").write_bytes(pickle.dumps(meta))
    write_manifest(ck)
    refused(cfg, r"\.metadata: an entry points at '\.\./\.\./.*etc/passwd', not a file of this checkpoint")


def test_latest_checkpoint_is_the_one_checked(run, model_src):
    cfg, ck = run
    newer = write_run_checkpoint(cfg, model_src, step=3)
    truncate(newer / "rollout.pt")
    msg = refused(cfg, r"step_00000003/rollout\.pt")
    assert "remove " + str(newer) + " to resume from step_00000002" in msg
    shutil.rmtree(newer)
    assert latest_checkpoint(cfg.run_dir) == ck and checked_resume_point(cfg, 1) == ck


def test_resume_refuses_a_code_running_metadata_before_anything_reads_it(run, tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    from tests.unit.test_untrusted_checkpoint import ViaLoadFromBytes

    cfg, ck = run
    mark = tmp_path / "pwned"
    (ck / "model" / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={},
                                                                   planner_data=ViaLoadFromBytes(mark))))
    write_manifest(ck)  # an attacker seals it too
    refused(cfg, r"model/\.metadata: refused to load: torch\.storage\._load_from_bytes is not a checkpoint-metadata")
    assert not mark.exists()
