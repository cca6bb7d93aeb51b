"""One live run per run directory: `<run_dir>/run.lock`, an flock held by the run's driver for its whole life.

The kernel drops an flock when the last process holding it ends, however it ends, so a crashed or killed run
never leaves the directory locked; the file's content (pid, host, start time, command) only names the holder
for the refusal. A second `mega-async train` on a directory in use is refused before it writes anything.
On a filesystem without locks (some Lustre mounts) the run goes on with a warning.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Optional

logger = logging.getLogger("mega_async.run.lock")

LOCK_FILE = "run.lock"
ENDED_WAIT_S = 30.0  # how long a start waits for the stopping processes of a run that just ended


class RunDirLockError(RuntimeError):
    """The run directory cannot be locked for this run (one line)."""


class RunDirInUse(RunDirLockError):
    """Another live run holds the run directory."""


class RunDirLock:
    """`RunDirLock.acquire(run_dir)` creates the directory if needed and locks it, or raises RunDirInUse (one
    line naming the holder). Held until `release()` or the end of every process that has its descriptor."""

    def __init__(self, run_dir: Path, fd: Optional[int], created: Optional[Path] = None):
        self.run_dir, self.fd, self.created = run_dir, fd, created  # created: the topmost folder made for it

    @classmethod
    def acquire(cls, run_dir: str | Path, wait_for_ended: float = ENDED_WAIT_S) -> "RunDirLock":
        """Lock `run_dir`. Held by what is left of a run whose command ended on this host (a kill -9 mid-save
        leaves a writer Megatron forked, the local launcher's agent stops its ranks): wait up to `wait_for_ended`
        seconds for it to go, as it does within seconds, then refuse."""
        d = Path(run_dir)
        created = next((p for p in reversed([d, *d.parents]) if not p.exists()), None)
        try:
            return cls._acquire(d, created, wait_for_ended)
        except RunDirLockError:
            _remove_made(d, created)
            raise
        except OSError as e:  # a read-only or full disk, a run.lock that is no file: one line, nothing left behind
            _remove_made(d, created)
            where = e.filename or d
            raise RunDirLockError(f"cannot lock the run directory {d}: {e.strerror} ({where}); "
                                  f"{_fix(e.errno)}") from None

    @classmethod
    def _acquire(cls, d: Path, created: Optional[Path], wait_for_ended: float) -> "RunDirLock":
        d.mkdir(parents=True, exist_ok=True)
        path = d / LOCK_FILE
        deadline, said = time.monotonic() + wait_for_ended, False
        while True:
            fd = _open(path)
            state = _flock(fd, path)
            if state == "unsupported":
                return cls(d, None, created)
            if state == "busy":
                os.close(fd)
                if not (_ended_here(holder(d)) and time.monotonic() < deadline):
                    raise RunDirInUse(in_use_message(d))
                if not said:
                    logger.warning("%s: waiting for the processes of the run that just ended to finish stopping", d)
                    said = True
                time.sleep(0.2)
                continue
            try:  # the file we locked must still be the one at the path (a holder may have just removed it)
                if os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                "command": " ".join(["mega-async", *sys.argv[1:]])[:300]}
        record = (json.dumps(info) + "\n").encode()
        try:
            if os.fstat(fd).st_size < len(record):  # room for the record first: a full disk never empties the file
                try:
                    os.posix_fallocate(fd, 0, len(record))
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):  # no fallocate here: write
                        raise
            os.pwrite(fd, record, 0)
            os.ftruncate(fd, len(record))
        except OSError as e:
            os.close(fd)
            e.filename = e.filename or str(path)
            raise
        return cls(d, fd, created)

    def release(self) -> None:
        """Unlock (early; process exit does it too). A directory this lock created that holds nothing else goes
        (a start refused for bad input leaves no run directory behind)."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if self.created is not None and os.listdir(self.run_dir) == [LOCK_FILE]:
                os.unlink(self.run_dir / LOCK_FILE)
                d = self.run_dir
                while True:  # the folders made for it, while empty
                    os.rmdir(d)
                    if d == self.created:
                        break
                    d = d.parent
        os.close(self.fd)
        self.fd = None


    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def refuse_if_in_use(run_dir: str | Path) -> None:
    """Raise RunDirInUse (one line naming the holder) when a live run holds `run_dir`, without creating or taking
    anything: for commands that prepare a run elsewhere (`mega-async launch slurm`) and must not touch a
    directory another run owns. A directory without a lock file, or on a filesystem without locks, passes."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RunDirLockError(f"{path}: is a symbolic link; a run directory must hold its own files: remove it, "
                                  "or choose another trial_name") from None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunDirInUse(in_use_message(Path(run_dir))) from None
    finally:
        os.close(fd)  # the probe's lock (if taken) goes with the descriptor


def _open(path: Path) -> int:
    try:  # O_NOFOLLOW: a link planted at run.lock is refused, not followed (and never truncated); O_NONBLOCK: a FIFO
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RunDirLockError(f"{path}: is a symbolic link; a run directory must hold its own files: remove it, "
                                  "or choose another trial_name") from None
        if e.errno == errno.EISDIR:
            raise RunDirLockError(f"{path}: is a directory, not the run's lock file: remove it, or choose another "
                                  "trial_name") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunDirLockError(f"{path}: is not a regular file (a FIFO or device), not the run's lock file: remove "
                              "it, or choose another trial_name")
    return fd


def _fix(err: Optional[int]) -> str:
    if err == errno.ENOSPC or err == errno.EDQUOT:
        return "free some space there, or choose another logging.root_dir"
    if err in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "choose a writable logging.root_dir"
    return "check the run directory, or choose another logging.root_dir or trial_name"


def _remove_made(d: Path, created: Optional[Path]) -> None:
    """The folders a failed lock made (from `created` down to `d`), while they hold nothing but an empty lock."""
    if created is None:
        return
    with contextlib.suppress(OSError):
        lock = d / LOCK_FILE
        if lock.is_file() and not lock.is_symlink() and lock.stat().st_size == 0:
            lock.unlink()
        while True:
            os.rmdir(d)
            if d == created:
                break
            d = d.parent


def _flock(fd: int, path: Path) -> str:
    """"locked", "busy" (another holder) or "unsupported" (a filesystem without locks: warned once here)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "locked"
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return "busy"
        if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            os.close(fd)
            logger.warning("%s: this filesystem does not support locks (%s); a second run on the same directory "
                           "would not be refused", path, e.strerror)
            return "unsupported"
        os.close(fd)
        raise


def holder(run_dir: str | Path) -> dict:
    """The lock file's record of the run holding it ({} when unreadable)."""
    try:
        with open(Path(run_dir) / LOCK_FILE, "rb") as f:
            info = json.loads(f.read(4096) or b"{}")
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def in_use_message(run_dir: Path) -> str:
    h = holder(run_dir)
    who = (f"pid {h.get('pid', '?')} on host {h.get('host', '?')}, started {h.get('started', '?')}"
           + (f": {h['command']}" if h.get("command") else ""))
    if _ended_here(h):  # its command is gone, what it started still holds the lock while it stops
        return (f"run directory {run_dir} is still held by processes of a run that ended ({who}): find them with "
                f"`fuser {run_dir / LOCK_FILE}` and stop them")
    return (f"run directory {run_dir} is in use by another run ({who}); wait for it to end or stop it "
            f"(kill {h.get('pid', '<pid>')}), or choose another trial_name")


def _ended_here(h: dict) -> bool:
    """The holder named in the lock file ran on this host and has ended."""
    pid = h.get("pid")
    if h.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
