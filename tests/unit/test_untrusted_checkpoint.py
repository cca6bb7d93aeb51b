"""Checkpoint files are untrusted input: a crafted pickle in `.metadata`, `common.pt` or an object entry of a
`.distcp` file is refused with one line naming the file before anything unpickles it (torch's and Megatron's
readers would run it: each exploit is shown to work on the stock reader first)."""
import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from mega_async.checkpoint.format import CheckpointError, check_dist_checkpoint
from mega_async.checkpoint.convert import HF_SUBDIR, META, main as convert
from mega_async.utils.safe_load import dist_load
from tests.unit.checkpoint_builder import EXTRA, WEIGHT, one_rank_group, save_model_dir, sharded_state_dict

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
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                 "common_backend": "torch", "common_backend_version": 1}))
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


# ---- issue 18.1 (a): a gadget in .metadata that calls torch.load without weights_only ------------------------
class ViaLoadFromBytes:
    """Unpickles as torch.storage._load_from_bytes(<a torch.save'd Evil>): torch.load(weights_only=False) runs it."""

    def __init__(self, mark: Path):
        buf = io.BytesIO()
        torch.save(EvilAt(mark), buf)
        self.payload = buf.getvalue()

    def __reduce__(self):
        return (torch.storage._load_from_bytes, (self.payload,))


class EvilAt:
    def __init__(self, mark: Path):
        self.mark = str(mark)

    def __reduce__(self):
        return (exec, (f"open({self.mark!r}, 'w').write('pwned')",))


def test_metadata_gadget_through_load_from_bytes_is_refused(tmp_path, capsys):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    mark = tmp_path / "pwned"
    d = fake_checkpoint(tmp_path, pickle.dumps(Metadata(state_dict_metadata={}, planner_data=ViaLoadFromBytes(mark))))
    FileSystemReader(str(d)).read_metadata()  # the stock reader runs it: the exploit is real
    assert mark.read_text() == "pwned"
    mark.unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to load: torch\.storage\._load_from_bytes is not a "
                                              r"checkpoint-metadata class"):
        check_dist_checkpoint(d)
    rc = convert(["mcore-to-hf", "--mcore", str(d), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and f"{d / '.metadata'}: refused to load: torch.storage._load_from_bytes" in err
    assert not mark.exists() and not (tmp_path / "out").exists()


# ---- issue 18.1 (b): an object entry of a .distcp pointing at an appended torch.save'd payload ---------------
@pytest.fixture(scope="module")
def group():
    with one_rank_group():
        yield


def poisoned(model_dir: Path, mark: Path) -> None:
    """Append torch.save(Evil) to the .distcp holding the `_extra_state` object and point its entry there."""
    meta = pickle.loads((model_dir / ".metadata").read_bytes())  # our own file: plain pickle is fine here
    idx = next(i for i in meta.storage_data if i.fqn.startswith(EXTRA))
    info = meta.storage_data[idx]
    f = model_dir / info.relative_path
    buf = io.BytesIO()
    torch.save(EvilAt(mark), buf)
    offset = f.stat().st_size
    with f.open("ab") as out:
        out.write(buf.getvalue())
    info.offset, info.length = offset, len(buf.getvalue())
    (model_dir / ".metadata").write_bytes(pickle.dumps(meta))


def test_distcp_object_entry_with_a_payload_is_refused(group, tmp_path, capsys):
    from megatron.core import dist_checkpointing

    mark = tmp_path / "pwned"
    d = save_model_dir(tmp_path / "mcore")
    state = dist_load(sharded_state_dict(torch.zeros(3, 4)), d)["model"]  # the genuine checkpoint loads
    assert state[EXTRA] is None and state[WEIGHT].equal(torch.arange(12.0).reshape(3, 4))
    poisoned(d, mark)
    with pytest.raises(TypeError):  # Megatron's stock load runs the payload (then trips over its result, None)
        dist_checkpointing.load(sharded_state_dict(torch.zeros(3, 4)), str(d))
    assert mark.read_text() == "pwned"
    mark.unlink()
    line = rf"{d}/__0_0\.distcp: {EXTRA}/shard_0_1: refused to load: .*only tensors and plain containers"
    with pytest.raises(CheckpointError, match=line):
        check_dist_checkpoint(d)  # before any library reads it
    with pytest.raises(CheckpointError, match=line):
        dist_load(sharded_state_dict(torch.zeros(3, 4)), d)  # and the load itself reads objects tensors-only
    (d / HF_SUBDIR).mkdir()
    (d / META).write_text(json.dumps({"format": "megatron-dist-ckpt", "allocation": "megatron:d1"}))
    rc = convert(["mcore-to-hf", "--mcore", str(d), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "__0_0.distcp: " in err and "refused to load" in err
    assert not mark.exists()


def test_convert_refuses_links_in_the_checkpoint(group, tmp_path, capsys):
    d = save_model_dir(tmp_path / "mcore")
    (d / HF_SUBDIR).mkdir()
    (d / HF_SUBDIR / "tokenizer.json").symlink_to("/etc/passwd")  # would be copied into the export
    (d / META).write_text(json.dumps({"format": "megatron-dist-ckpt", "allocation": "megatron:d1"}))
    rc = convert(["mcore-to-hf", "--mcore", str(d), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "hf/tokenizer.json: is a symbolic link (to /etc/passwd)" in err
    shutil.rmtree(d)


class _Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickled_weights_file_is_never_loaded_by_the_server(tmp_path):
    """A model directory holding only pytorch_model.bin (a pickle) is refused by the embedded server's loader
    without unpickling it: weights come from safetensors only."""
    import shutil

    import torch

    from mega_async.server.weights import load_pretrained

    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(Path(__file__).resolve().parents[2] / "models" / "tiny-qwen3-moe" / "config.json", d)
    marker = tmp_path / "ran"
    torch.save({"gadget": _Marker(str(marker))}, d / "pytorch_model.bin")
    with pytest.raises((OSError, ValueError, EnvironmentError)):
        load_pretrained(d, torch.float32)
    assert not marker.exists()
