"""Conversions and exports write through a partial folder of their own and swap it in whole
(mega_async.trainer.weights: partial_dir, swap_in): two writers to one output never share a partial folder, and the
one finishing second replaces the first's output instead of failing on a non-empty directory (before: both used
`<out>.partial`, the second's rmtree removed the first's files mid-save)."""
import threading
from pathlib import Path

import pytest

from mega_async.trainer.weights import partial_dir as _partial_dir, swap_in
from mega_async.utils.outputs import EXPORT_MARK, OutputInUse, check_replaceable


def test_each_conversion_gets_its_own_partial_folder(tmp_path):
    out = tmp_path / "sub" / "mcore"
    a, b = _partial_dir(out), _partial_dir(out)
    assert a != b and a.is_dir() and b.is_dir() and a.parent == b.parent == out.parent
    assert a.name.startswith("mcore.partial.") and b.name.startswith("mcore.partial.")


def test_writers_finishing_together_each_swap_in_a_whole_output(tmp_path):
    out = tmp_path / "out"
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            for i in range(40):
                tmp = _partial_dir(out)
                for j in range(5):
                    (tmp / f"f{j}").write_text(f"{k}-{i}")
                swap_in(tmp, out)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    files = [p for p in out.iterdir() if p.name != EXPORT_MARK]
    assert len({p.read_text() for p in files}) == 1 and len(files) == 5  # one writer's whole output
    assert (out / EXPORT_MARK).read_text().strip() == "hf"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing partial or old left


def _export(out, kind="hf", text="w"):
    tmp = _partial_dir(out, kind)
    (tmp / "model.safetensors").write_text(text)
    swap_in(tmp, out, kind)


def test_an_export_replaces_only_an_earlier_export_of_its_kind(tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # an empty folder is taken
    _export(out, text="1")
    _export(out, text="2")  # its own earlier export: replaced whole
    assert (out / "model.safetensors").read_text() == "2"
    with pytest.raises(OutputInUse, match="holds a mega-async 'hf' export, not a 'mcore' one"):
        _export(out, "mcore")
    assert (out / "model.safetensors").read_text() == "2"


@pytest.mark.parametrize("what", ["a file", "a folder", "a source model", "a link", "a plain file as out"])
def test_anything_else_is_refused_in_one_line_and_left_alone(tmp_path, what):
    out = tmp_path / "out"
    if what == "a plain file as out":
        out.write_text("precious")
    elif what == "a link":
        (tmp_path / "elsewhere").mkdir()
        out.symlink_to(tmp_path / "elsewhere")
    else:
        out.mkdir()
        if what == "a file":
            (out / "precious.txt").write_text("precious")
        elif what == "a folder":
            (out / "sub").mkdir()
        else:  # an HF model's own folder (config, tokenizer, weights), not written by an export: never replaced
            for name in ("config.json", "tokenizer.json", "model.safetensors"):
                (out / name).write_text("theirs")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for kind in ("hf", "mcore"):
        with pytest.raises(OutputInUse) as e:
            _export(out, kind)
        assert "\n" not in str(e.value) and str(out) in str(e.value) and "not replaced" in str(e.value)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # untouched; no partial folder left


def test_a_runs_own_exports_from_before_the_mark_are_replaced_where_the_run_says_so(tmp_path):
    out = tmp_path / "final_hf"
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "model-pp000-00000.safetensors", "model.safetensors.index.json"):
        (out / name).write_text("old")
    with pytest.raises(OutputInUse):
        check_replaceable(out, "hf")
    check_replaceable(out, "hf", legacy=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputInUse, match="not replaced"):
        check_replaceable(out, "hf", legacy=True)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_an_export_follows_the_umask(tmp_path, mask):
    import os
    import stat

    old = os.umask(mask)
    try:
        tmp = _partial_dir(tmp_path / "out")
        (tmp / "sub").mkdir()
        fd = os.open(tmp / "model.safetensors", os.O_CREAT | os.O_WRONLY, 0o600)  # a writer that makes files 0600
        os.close(fd)
        (tmp / "sub" / "config.json").write_text("{}")
        swap_in(tmp, tmp_path / "out")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "out", *(tmp_path / "out").rglob("*")]}
    assert modes == {"out": 0o777 & ~mask, "sub": 0o777 & ~mask, "model.safetensors": 0o666 & ~mask,
                     "config.json": 0o666 & ~mask, EXPORT_MARK: 0o666 & ~mask}
