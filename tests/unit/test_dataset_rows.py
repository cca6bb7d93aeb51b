"""Dataset rows that used to crash or mislead a run (issue 33 items 6 and 14): a huge row (tokenizing 200 MB asked
for 3.3 GB and the process died of a Rust allocation failure) and a row that is not UTF-8 (reported by byte
position in some decode buffer, not by file and row). Each is one line naming the file and the row."""
import json
import tracemalloc
from pathlib import Path

import pytest

from mega_async.cli import main
from mega_async.data import load_rows

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
LIMIT = 1 << 20  # data.max_row_bytes for these tests: the huge row is 3 MB, the file a few MB


def _rows(path: Path, middle: bytes) -> Path:
    path.write_bytes(b'{"prompt": "first"}\n' + middle + b'\n{"prompt": "last"}\n')
    return path


def test_a_row_over_the_size_limit_is_refused_in_one_line_before_it_is_read_whole(tmp_path):
    path = _rows(tmp_path / "huge.jsonl", json.dumps({"prompt": "a" * (3 << 20)}).encode())
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as e:
            load_rows(path, LIMIT)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: row larger than data.max_row_bytes={LIMIT} bytes") and "\n" not in msg, msg
    assert peak < 2 * LIMIT + (256 << 10), f"read {peak} bytes to refuse it"  # the row was never read whole
    ok = _rows(tmp_path / "ok.jsonl", json.dumps({"prompt": "a" * (LIMIT - 20)}).encode())  # at the limit: kept
    assert [len(r["prompt"]) for r in load_rows(ok, LIMIT)] == [5, LIMIT - 20, 4]


def test_a_huge_parquet_row_is_refused_naming_the_row(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "huge.parquet"
    pq.write_table(pa.table({"prompt": ["first", "a" * (3 << 20), "last"]}), path)
    with pytest.raises(ValueError, match=rf"^{path}: row 1: row larger than data.max_row_bytes={LIMIT} bytes"):
        load_rows(path, LIMIT)
    assert len(load_rows(path)) == 3  # the default limit (32 MiB) takes it


def test_invalid_utf8_names_the_file_and_the_line(tmp_path):
    path = _rows(tmp_path / "latin1.jsonl", '{"prompt": "café"}'.encode("latin-1"))
    with pytest.raises(ValueError) as e:
        load_rows(path)
    msg = str(e.value)
    assert msg == f"{path}:2: not UTF-8 (invalid continuation byte at byte 16 of the row)", msg


@pytest.mark.parametrize("middle, expect", [
    (json.dumps({"prompt": "a" * (3 << 20)}).encode(), f":2: row larger than data.max_row_bytes={LIMIT} bytes"),
    ('{"prompt": "café"}'.encode("latin-1"), ":2: not UTF-8 (invalid continuation byte at byte 16 of the row)"),
])
def test_the_run_refuses_such_a_dataset_at_start_up_in_one_line(tmp_path, capsys, middle, expect):
    path = _rows(tmp_path / "data.jsonl", middle)
    rc = main(["train", "-c", TINY, f"logging.root_dir={tmp_path / 'runs'}", "data.name=jsonl", f"data.path={path}",
               "data.reward=gsm8k", f"data.max_row_bytes={LIMIT}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and f"data.path={path}: ValueError: {path}{expect}" in err, err
    assert not (tmp_path / "runs").exists()
