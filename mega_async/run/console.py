"""Quiet console for `mega-async train`: our own INFO lines and a per-step progress bar on the console;
third-party INFO (Megatron's bucket listings, optimizer configs) and Python warnings go to `<run_dir>/train.log`.

The log file is opened once the run directory exists (the driver creates it after its input checks), so a
run refused for bad input leaves no directory behind; records until then are kept in memory and written first.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional

from mega_async.utils.diskspace import append_line

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
OWN = "mega_async"
THIRD_PARTY_CONSOLE_LEVEL = logging.ERROR  # other libraries reach the console only with errors


class OwnOrSevere(logging.Filter):
    """Console filter: our records at the configured level, anyone else's only from ERROR up."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name == OWN or record.name.startswith(OWN + ".")
        return record.levelno >= (self.level if own else THIRD_PARTY_CONSOLE_LEVEL)


class RunDirFileHandler(logging.Handler):
    """Everything to `<run_dir>/<name>`, buffered in memory until the run directory exists. Each record goes out
    whole or not at all; when the file cannot be written (a full disk) one line on stderr names it and why, and
    the run goes on logging to the console only."""

    def __init__(self, run_dir: str | Path, name: str = "train.log", max_buffered: int = 10000):
        super().__init__(logging.DEBUG)
        self.path = Path(run_dir) / name
        self._buffer: list[logging.LogRecord] = []
        self._max = max_buffered
        self._fd: Optional[int] = None
        self._broken = False

    def emit(self, record: logging.LogRecord) -> None:
        if self._broken:
            return
        try:
            if self._fd is None and self.path.parent.is_dir():
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                for r in self._buffer:
                    self._write(r)
                self._buffer.clear()
            if self._fd is None:
                if len(self._buffer) < self._max:
                    self._buffer.append(record)
                return
            self._write(record)
        except OSError as e:  # logging never stops a run; a file it cannot write is named once, not per record
            self._broken = True
            self._buffer.clear()
            with contextlib.suppress(Exception):
                sys.stderr.write(f"mega-async: cannot write the log file: {e}; logging to the console only\n")
        except Exception:  # noqa: BLE001
            self.handleError(record)

    def _write(self, record: logging.LogRecord) -> None:
        append_line(self._fd, (self.format(record) + "\n").encode("utf-8", "replace"), self.path)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._buffer.clear()
        super().close()


class ProgressHandler(logging.StreamHandler):
    """Console handler that keeps a tqdm bar of training steps under the log lines (TTY only); a record
    logged with `extra={"progress_step": i}` advances it to step i + 1."""

    def __init__(self, total: Optional[int], stream: Any = None):
        super().__init__(stream or sys.stderr)
        self.bar = None
        if total and getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", file=self.stream, dynamic_ncols=True, leave=False,
                             mininterval=0)

    def emit(self, record: logging.LogRecord) -> None:
        if self.bar is None:
            return super().emit(record)
        try:
            self.bar.write(self.format(record), file=self.stream)
            step = getattr(record, "progress_step", None)
            if isinstance(step, int) and step + 1 > self.bar.n:
                self.bar.update(step + 1 - self.bar.n)
        except Exception:  # noqa: BLE001
            self.handleError(record)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        super().close()


def setup_logging(level: str, run_dir: str | Path | None = None, total_steps: Optional[int] = None,
                  verbose: bool = False) -> list[logging.Handler]:
    """Console (quiet unless `verbose`) plus the run's log file; returns the handlers installed on the root."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    lvl = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    console = ProgressHandler(total_steps)
    console.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    if not verbose:
        console.addFilter(OwnOrSevere(lvl))
    handlers: list[logging.Handler] = [console]
    if run_dir is not None:
        rank = os.environ.get("RANK", "0")
        f = RunDirFileHandler(run_dir, "train.log" if rank == "0" else f"train_rank{rank}.log")
        f.setFormatter(logging.Formatter(FORMAT))
        handlers.append(f)
    root.setLevel(min(lvl, logging.INFO))
    for h in handlers:
        root.addHandler(h)
    # warnings.warn (Apex/TE fall-backs, deprecations) -> py.warnings -> log file. Off first: captureWarnings(True)
    # does nothing while logging still holds a showwarning it saved earlier (e.g. inside someone's
    # warnings.catch_warnings, which has since put its own back)
    logging.captureWarnings(False)
    logging.captureWarnings(True)
    return handlers
