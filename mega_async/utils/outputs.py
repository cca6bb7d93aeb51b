"""Output folders that exports replace: every folder an export writes (an HF directory, a Megatron checkpoint from
the converter) carries a mark file naming its kind, and an export replaces an existing folder only when it is
empty or marked with the same kind. Anything else (a models folder, a home directory, the source model's own
folder, an export of the other kind) is refused in one line, before any work, and nothing in it is touched."""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Optional

EXPORT_MARK = ".mega_async_export"  # its text: the kind of export that wrote the folder
KINDS = ("hf", "mcore")
# what a run's own HF exports held before the mark existed (final_hf, hf_snapshots/step_N, the disk sync's
# weights/vN, all inside a run directory the run locked): replaced as marked ones are where the caller says so
_LEGACY_HF = re.compile(r"(model[\w.-]*\.safetensors|model\.safetensors\.index\.json|config\.json|"
                        r"generation_config\.json|tokenizer[\w.-]*|special_tokens_map\.json|added_tokens\.json|"
                        r"vocab[\w.-]*|merges\.txt|chat_template\.jinja)")


class OutputInUse(ValueError):
    """An export's output folder holds something that no earlier export of its kind wrote (one line)."""


def mark(folder: Path, kind: str) -> None:
    """Mark a folder an export is writing as an export of `kind`."""
    if kind not in KINDS:
        raise ValueError(f"export kind {kind!r}: one of {KINDS}")
    (folder / EXPORT_MARK).write_text(kind + "\n")


def marked(folder: Path) -> Optional[str]:
    """The kind a folder is marked with (None: no mark, or not a plain file)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        return _mark_at(fd)
    finally:
        os.close(fd)


def _mark_at(dir_fd: int) -> Optional[str]:
    try:
        fd = os.open(EXPORT_MARK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, 64).decode(errors="replace").strip() or None
    finally:
        os.close(fd)


def check_replaceable(out: Path, kind: str, legacy: bool = False) -> None:
    """Raise OutputInUse (one line naming `out` and the fix) unless an export of `kind` may replace `out`: absent,
    an empty folder, or a folder marked with `kind`. `legacy`: also an unmarked folder holding only the files an
    HF export of a run writes (a run directory's own exports from before the mark). The folder is read through one
    descriptor, so another writer swapping its own export in meanwhile is read whole or not at all."""
    out = Path(out)
    fix = "give another output folder, or remove it yourself"
    while True:
        try:
            mode = os.lstat(out).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(mode):
            raise OutputInUse(f"{out} exists and is not a folder an export wrote (a "
                              f"{'link' if stat.S_ISLNK(mode) else 'file'}): not replaced; {fix}")
        try:
            fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return  # nothing there (or another writer moved it aside just now)
        except OSError as e:
            raise OutputInUse(f"{out} cannot be read ({e.strerror}): not replaced; {fix}") from None
        try:
            found = _mark_at(fd)
            entries = sorted(os.listdir(fd))
            plain = all(_is_file_at(n, fd) for n in entries)
            moved = _moved(out, fd)
        finally:
            os.close(fd)
        if not moved:  # else another writer swapped its export in while this looked: look again
            break
    if not entries or found == kind:
        return
    if found is not None:
        raise OutputInUse(f"{out} holds a mega-async {found!r} export, not a {kind!r} one: not replaced; {fix}")
    if legacy and kind == "hf" and plain and all(_LEGACY_HF.fullmatch(n) for n in entries):
        return
    shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
    raise OutputInUse(f"{out} is not empty and no mega-async {kind} export wrote it (it holds {shown}): not "
                      f"replaced; {fix}")


def _is_file_at(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _moved(path: Path, fd: int) -> bool:
    """The folder open at `fd` is no longer the one at `path` (renamed away, or removed)."""
    try:
        return os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino
    except FileNotFoundError:
        return True


def umask() -> int:
    """This process's umask, read without changing it (Linux: /proc/self/status; elsewhere set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(folder: Path) -> None:
    """Give an export's folder and everything in it the modes a plain mkdir and open would (0o777 / 0o666 less the
    umask), as checkpoints have: temporary folders are made private (0700) and some writers create files 0600, so an
    export would otherwise be unreadable by a team mate or an inference service running as another user."""
    mask = umask()
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)
