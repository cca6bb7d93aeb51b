"""`mega-async convert ... --out D` never deletes what D held: a folder that is not an earlier export of the same
kind (unrelated files, the source model's own folder, an export of the other kind) is refused in one line before
any work, and everything in it stays; an earlier conversion's own output is replaced whole."""
import shutil
import subprocess

import pytest

from tests.commands import ROOT, mega_async

CARD = ROOT / "models" / "tiny-qwen3-moe"


def convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(mega_async("convert", *args), capture_output=True, text=True, timeout=600, cwd=ROOT)


def tree(d):
    return sorted((str(p.relative_to(d)), p.read_bytes() if p.is_file() else b"") for p in d.rglob("*"))


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    from mega_async.bridge.model_cards import ensure_weights

    d = tmp_path_factory.mktemp("card") / "tiny-qwen3-moe"
    shutil.copytree(CARD, d, ignore=shutil.ignore_patterns("*.safetensors*"))
    ensure_weights(d)
    return d


def test_a_folder_with_other_files_is_refused_and_kept(tmp_path, card):
    out = tmp_path / "D"
    (out / "sub").mkdir(parents=True)
    (out / "precious.txt").write_text("precious")
    (out / "sub" / "notes").write_text("mine")
    before = tree(tmp_path)
    r = convert("hf-to-mcore", "--hf", str(card), "--out", str(out))  # (mcore-to-hf: the slow test below)
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("convert: ") and str(out) in line and "not replaced" in line, line
    assert tree(tmp_path) == before  # nothing deleted, nothing partial left beside it


def test_the_source_models_own_folder_is_refused(card):
    before = tree(card)
    r = convert("hf-to-mcore", "--hf", str(card), "--out", str(card))
    assert r.returncode == 2 and "no mega-async mcore export wrote it" in r.stderr, r.stderr[-2000:]
    assert tree(card) == before


@pytest.mark.slow
def test_an_earlier_conversion_is_replaced_and_the_other_kind_refused(tmp_path, card):
    mc = tmp_path / "mc"
    for _ in range(2):  # the second replaces the first's output whole
        r = convert("hf-to-mcore", "--hf", str(card), "--out", str(mc))
        assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mc"]
    r = convert("mcore-to-hf", "--mcore", str(mc), "--out", str(mc))
    assert r.returncode == 2 and "holds a mega-async 'mcore' export, not a 'hf' one" in r.stderr, r.stderr[-2000:]
    assert (mc / "mega_async_meta.json").exists()
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    (other / "precious.txt").write_text("precious")
    r = convert("mcore-to-hf", "--mcore", str(mc), "--out", str(other))
    assert r.returncode == 2 and "no mega-async hf export wrote it" in r.stderr, r.stderr[-2000:]
    assert (other / "precious.txt").read_text() == "precious" and (other / "sub").is_dir()


@pytest.mark.slow
def test_the_converter_keeps_the_sources_dtype_and_converts_to_dtype(tmp_path, card):
    """A bf16 checkpoint stays bf16 both ways (before: fp32 files, twice the size, under a config.json that still
    said bfloat16); --dtype converts, and config.json says what the weights are."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    bf = tmp_path / "bf"
    shutil.copytree(card, bf)
    w = load_file(bf / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in w.items()}, str(bf / "model.safetensors"))
    cfg = json.loads((bf / "config.json").read_text())
    (bf / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    for args in (["hf-to-mcore", "--hf", str(bf), "--out", str(tmp_path / "mc")],
                 ["mcore-to-hf", "--mcore", str(tmp_path / "mc"), "--out", str(tmp_path / "hf")],
                 ["mcore-to-hf", "--mcore", str(tmp_path / "mc"), "--out", str(tmp_path / "hf32"), "--dtype", "float32"]):
        r = convert(*args)
        assert r.returncode == 0, r.stderr[-3000:]
    src = load_file(bf / "model.safetensors")
    for out, dtype in (("hf", torch.bfloat16), ("hf32", torch.float32)):
        got = load_file(tmp_path / out / "model.safetensors")
        assert {v.dtype for v in got.values()} == {dtype}
        assert got.keys() == src.keys() and all(torch.equal(got[k].to(torch.bfloat16), src[k]) for k in src)
        assert json.loads((tmp_path / out / "config.json").read_text())["dtype"] == str(dtype)[6:]
    distcp = sum(p.stat().st_size for p in (tmp_path / "mc").glob("*.distcp"))
    assert distcp < 1.6 * (bf / "model.safetensors").stat().st_size  # bf16 on disk (fp32 would be over 2x)
