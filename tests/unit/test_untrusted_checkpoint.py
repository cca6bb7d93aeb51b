"""Checkpoint files are untrusted input: a crafted pickle in `.metadata` or `common.pt` is refused with one
line before anything unpickles it (torch's distributed-checkpoint reader would run it)."""
import json
import pickle
from pathlib import Path

import pytest
import torch

from mega_async.checkpoint import CheckpointError, check_dist_checkpoint
from mega_async.convert import HF_SUBDIR, META, main as convert

MARK = Path("/tmp/mega_async_pwned_by_checkpoint")


class Evil:
    def __reduce__(self):
        return (exec, (f"open({str(MARK)!r}, 'w').write('x')",))


class Harmless:  # not a tensor or a plain container: weights_only refuses it too
    pass


def fake_checkpoint(tmp_path, metadata: bytes, common=None):
    d = tmp_path / "mcore"
    (d / HF_SUBDIR).mkdir(parents=True)
    (d / META).write_text(json.dumps({"format": "megatron-dist-ckpt", "allocation": "megatron:d1"}))
    (d / ".metadata").write_bytes(metadata)
    if common is not None:
        torch.save(common, d / "common.pt")
    return d


def test_convert_refuses_a_crafted_metadata_file(tmp_path, capsys):
    MARK.unlink(missing_ok=True)
    d = fake_checkpoint(tmp_path, pickle.dumps(Evil()))
    rc = convert(["mcore-to-hf", "--mcore", str(d), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "refused to load: builtins.exec is not a checkpoint-metadata class" in err
    assert not MARK.exists() and not (tmp_path / "out").exists()


def test_common_pt_with_arbitrary_objects_is_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    d = fake_checkpoint(tmp_path, pickle.dumps(Metadata(state_dict_metadata={})), common={"x": Harmless()})
    with pytest.raises(CheckpointError, match=r"common\.pt: refused to load: .*only tensors and plain containers"):
        check_dist_checkpoint(d)
    torch.save({"step": 3, "t": torch.zeros(2)}, d / "common.pt")
    check_dist_checkpoint(d)  # genuine content passes


def test_getattr_gadgets_are_refused(tmp_path):
    gadget = b"cbuiltins\ngetattr\n(ctorch\nSize\nS'__reduce_ex__'\ntR."  # getattr(torch.Size, ...)
    with pytest.raises(CheckpointError, match=r"refused to load: getattr\('Size', '__reduce_ex__'\) is not allowed"):
        check_dist_checkpoint(fake_checkpoint(tmp_path, gadget))
    imp = b"cbuiltins\n__import__\n(S'os'\ntR."
    with pytest.raises(CheckpointError, match=r"builtins\.__import__ is not a checkpoint-metadata class"):
        check_dist_checkpoint(fake_checkpoint(tmp_path / "2", imp))
