"""Full disks: errors that say so, and appends that never leave half a line.

A write that runs out of space raises `DiskFull` (an OSError with errno ENOSPC) naming the file or directory and,
where known, how much the write needed and how much was free (the libraries underneath often say neither: torch's
checkpoint writer reports `unexpected pos 704 vs 598`, a buffered file `[Errno 28] No space left on device`
without its name). `append_line` writes one whole line to an append-only log or nothing: a line cut short by a
full disk is taken back, so the run's JSONL logs never end in a torn line; `read_jsonl` reads them and skips a torn
last line all the same (a process killed mid-write, a log written before this rule).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

__all__ = ["DiskFull", "append_line", "free_bytes", "human", "named", "out_of_space", "read_jsonl", "replaced"]

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, over quota, over the file-size limit


class DiskFull(OSError):
    """A write failed for want of space. `str()` is one line: where, what was needed, what was free, the fix."""

    def __init__(self, message: str, path: str | os.PathLike = "", needed: Optional[int] = None,
                 free: Optional[int] = None):
        super().__init__(errno.ENOSPC, message)
        self.message, self.path, self.needed, self.free = message, str(path), needed, free

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple:  # picklable (its arguments are not OSError's)
        return type(self), (self.message, self.path, self.needed, self.free)


def human(n: Optional[float]) -> str:
    """Bytes for a person: 6.9 MB, 1.2 GB (powers of 1000, as `df -H`)."""
    if n is None:
        return "an unknown amount"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def free_bytes(path: str | os.PathLike) -> Optional[int]:
    """Bytes an unprivileged writer may still use on the filesystem holding `path` (its nearest existing parent);
    None when it cannot be asked."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def out_of_space(e: BaseException) -> bool:
    """Whether `e`, or an error it was raised from, is a full disk (ENOSPC, EDQUOT, EFBIG, or their messages)."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in _FULL:
            return True
        text = str(x)
        if "No space left on device" in text or "Disk quota exceeded" in text or "File too large" in text:
            return True
        stack += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint's CheckpointException: per rank
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()
                      if isinstance(f[0] if isinstance(f, tuple) else f, BaseException)]
    return False


def named(e: OSError, path: str | os.PathLike, what: str = "") -> OSError:
    """`e` as an error that names `path` (and says the disk is full when it is); raise it `from e`."""
    where = f"{what} {path}" if what else str(path)
    if out_of_space(e):
        free = free_bytes(path)
        why = os.strerror(e.errno) if e.errno in _FULL else "No space left on device"
        return DiskFull(f"{where}: {why} (the disk is full: {human(free)} free there); free space on that disk",
                        path, free=free)
    out = OSError(e.errno, f"{where}: {e.strerror or e}")
    out.filename = str(path)
    return out


def append_line(fd: int, data: bytes, path: str | os.PathLike) -> None:
    """Append `data` (one line, newline-terminated) to the O_APPEND file `fd` whole, or not at all: a write cut
    short (disk full) is taken back off the end of the file before the error, which names `path`. One write
    call normally: appends of other processes never interleave with it."""
    written = 0
    try:
        while written < len(data):
            n = os.write(fd, data[written:])
            if n <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written += n
    except OSError as e:
        if written:  # half a line went out: take it back (our bytes are the file's last unless another
            try:     # writer appended after them, which on a full disk it could not)
                end = os.fstat(fd).st_size
                os.ftruncate(fd, max(0, end - written))
            except OSError:
                pass
        raise named(e, path) from e


@contextlib.contextmanager
def replaced(path: str | os.PathLike) -> Iterator[Path]:
    """Write a whole file or nothing: yields a fresh temporary path next to `path` (a name no other writer uses)
    for the caller to write, then renames it over `path`. On any error the temporary file is removed and `path`
    keeps its old content, so a reader (or a second writer of the same file) never sees half of it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, DiskFull):
            raise named(e, path) from e
        raise


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL log, one per line; a last line without its newline that does not parse (torn
    by a kill or a full disk) is skipped. A torn line elsewhere is an error (the file was damaged)."""
    text = Path(path).read_text()
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # no newline after it: the write never finished
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON ({e.msg})") from None
    return out
