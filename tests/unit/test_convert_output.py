"""Conversions and exports write through a partial folder of their own and swap it in whole
(mega_async.trainer.weights: partial_dir, swap_in): two writers to one output never share a partial folder, and the
one finishing second replaces the first's output instead of failing on a non-empty directory (before: both used
`<out>.partial`, the second's rmtree removed the first's files mid-save)."""
import threading
from pathlib import Path

from mega_async.trainer.weights import partial_dir as _partial_dir, swap_in


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
    contents = {p.read_text() for p in out.iterdir()}
    assert len(contents) == 1 and len(list(out.iterdir())) == 5  # one writer's whole output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing partial or old left
