"""The one reader of HF weight files (`safe_load.SafetensorsDir`): by name and streamed, the same tensors; every
hostile directory refused in one line naming the file, as the error class its caller asked for."""
import os

import pytest
import torch
from safetensors.torch import save_file

from mega_async.bridge import HFTensors
from mega_async.server.weights import WeightLoadError, read_safetensors_dir
from mega_async.utils.safe_load import CheckpointError, SafetensorsDir


@pytest.fixture
def card(tmp_path):
    d = tmp_path / "card"
    d.mkdir()
    save_file({"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"c": torch.zeros(2, dtype=torch.bfloat16)}, str(d / "model-00002-of-00002.safetensors"))
    return d


def test_by_name_and_streamed_agree(card):
    r = SafetensorsDir(card)
    assert sorted(r.names()) == ["a", "b", "c"] and "b" in r and "z" not in r
    streamed = dict(SafetensorsDir(card).items())
    assert streamed.keys() == {"a", "b", "c"}
    assert all(torch.equal(streamed[k], r.get(k)) for k in streamed)
    assert streamed["c"].dtype == torch.bfloat16
    assert all(torch.equal(HFTensors(card).get(k), r.get(k)) for k in r.names())  # no FP8 block: as stored


def test_hostile_directories_are_refused_naming_the_file(tmp_path, card):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no \\*.safetensors files in .*empty"):
        SafetensorsDir(empty)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "model.safetensors")  # would block a reader forever
    with pytest.raises(WeightLoadError, match="model.safetensors is not a regular file"):
        list(read_safetensors_dir(fifo))
    link = tmp_path / "root" / "link"
    link.mkdir(parents=True)
    (link / "model.safetensors").symlink_to(card / "model-00001-of-00002.safetensors")
    with pytest.raises(WeightLoadError, match="outside the allowed weights root"):
        SafetensorsDir(link, root=tmp_path / "root", error=WeightLoadError)
    assert sorted(SafetensorsDir(link).names()) == ["a", "b"]  # with no root, a link is followed
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(CheckpointError, match="cannot read model.safetensors"):
        HFTensors(bad).names()
    with pytest.raises(WeightLoadError, match="cannot read model.safetensors"):
        list(read_safetensors_dir(bad))
