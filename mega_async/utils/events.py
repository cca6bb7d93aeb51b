"""The event timeline of a run: <run_dir>/events.jsonl, one JSON object per line, and its drawing.

Each line is {"t": unix seconds, "kind": ..., **fields}. Kinds written by the run:
  episode_admitted / episode_finished (verdict accepted | rejected | failed)   rollout executor
  episode_interrupted / episode_resubmitted                                     inference client
  sync_start / sync_end (phase: push = the whole sync; prepare | pause | update | commit | continue)  sync
  train_step_start / train_step_end (step, rank)                                trainer ranks
An `EventLog` is a handle passed to whoever emits (no module-level log); every rank may append to the
same file: each event is one O_APPEND write, so lines never interleave, and a write a full disk cuts short is
taken back (`mega_async.utils.diskspace.append_line`), so the file never ends in a torn line.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from mega_async.utils.diskspace import append_line, replaced

logger = logging.getLogger("mega_async.utils.events")


class EventLog:
    """Append-only JSONL event log (thread- and process-safe appends)."""

    def __init__(self, path: str | os.PathLike, **common: Any):
        self.path = Path(path)
        self.common = common  # fields added to every event, e.g. rank=3
        self._fd: Optional[int] = None  # opened at the first event: a run that stops early writes nothing
        self._closed = False
        self._lock = threading.Lock()

    def emit(self, kind: str, **fields: Any) -> None:
        """Append one event now, whole or not at all; never raises (a full disk must not stop a run: it is logged
        once, naming the file, and no more events are recorded)."""
        line = json.dumps({"t": round(time.time(), 6), "kind": kind, **self.common, **fields}, default=str) + "\n"
        with self._lock:
            if self._closed:
                return
            try:
                if self._fd is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                append_line(self._fd, line.encode(), self.path)
            except OSError as e:
                logger.warning("event log not writable: %s; no more events are recorded", e)
                self._close()

    @contextlib.contextmanager
    def span(self, kind: str, **fields: Any) -> Iterator[None]:
        """`<kind>_start` now and `<kind>_end` (with ok and seconds) when the block exits, even on an error."""
        t0 = time.monotonic()
        self.emit(f"{kind}_start", **fields)
        ok = False
        try:
            yield
            ok = True
        finally:
            self.emit(f"{kind}_end", ok=ok, seconds=round(time.monotonic() - t0, 6), **fields)

    def size(self) -> int:
        """Bytes of the file now (a checkpoint records it; a resume cuts the timeline back to it)."""
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def child(self, **common: Any) -> "EventLog":
        """A handle on the same file whose events carry extra fields (e.g. a rank)."""
        return EventLog(self.path, **{**self.common, **common})

    def _close(self) -> None:
        self._closed = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        with self._lock:
            self._close()

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class NullEventLog:
    """The EventLog interface that records nothing (for components used without a run directory)."""

    common: dict = {}

    def emit(self, kind: str, **fields: Any) -> None:
        pass

    @contextlib.contextmanager
    def span(self, kind: str, **fields: Any) -> Iterator[None]:
        yield

    def child(self, **common: Any) -> "NullEventLog":
        return self

    def size(self) -> int:
        return 0

    def close(self) -> None:
        pass


def read_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Events in time order; a torn last line (a run killed mid-write) and foreign lines are skipped."""
    out = []
    p = Path(path)
    if not p.is_file():
        return out
    for line in p.read_text(errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(ev, dict) and isinstance(ev.get("t"), (int, float)) and isinstance(ev.get("kind"), str):
            out.append(ev)
    return sorted(out, key=lambda e: e["t"])


def spans(events: list[dict], kind: str, key: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Pair `<kind>_start` with the next `<kind>_end` of the same key fields: [{start, end, **fields}]."""
    open_: dict[tuple, dict] = {}
    out = []
    for e in events:
        k = tuple(e.get(f) for f in key)
        if e["kind"] == f"{kind}_start":
            open_[k] = e
        elif e["kind"] == f"{kind}_end" and k in open_:
            s = open_.pop(k)
            out.append({**s, **e, "start": s["t"], "end": e["t"]})
    return out


def in_flight(events: list[dict]) -> tuple[list[float], list[int]]:
    """(times, episodes running) as a step curve from admitted / finished events."""
    ts, ns, n = [], [], 0
    for e in events:
        if e["kind"] == "episode_admitted":
            n += 1
        elif e["kind"] == "episode_finished":
            n = max(0, n - 1)
        else:
            continue
        ts.append(e["t"])
        ns.append(n)
    return ts, ns


def draw_timeline(events_path: str | os.PathLike, out_png: str | os.PathLike) -> Optional[Path]:
    """Draw where the time went: episodes in flight (interruptions marked), one training lane per rank,
    weight-sync phases; syncs shaded across both panels. Returns the PNG path, or None without events."""
    events = read_events(events_path)
    if not events:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = events[0]["t"]
    rel = lambda t: t - t0  # noqa: E731
    steps = spans(events, "train_step", ("rank", "step"))
    syncs = spans(events, "sync", ("phase", "rank"))
    ranks = sorted({s.get("rank", 0) for s in steps})
    phases = sorted({s.get("phase", "sync") for s in syncs})
    fig, (ax_r, ax_l) = plt.subplots(2, 1, sharex=True, figsize=(11, 3 + 0.35 * (len(ranks) + len(phases))),
                                     gridspec_kw={"height_ratios": [1.2, 1]})
    ts, ns = in_flight(events)
    if ts:
        ax_r.step([rel(t) for t in ts], ns, where="post", color="tab:blue", label="episodes in flight")
    intr = [rel(e["t"]) for e in events if e["kind"] == "episode_interrupted"]
    if intr:
        ax_r.plot(intr, [0] * len(intr), "|", color="tab:red", markersize=12, label=f"interruptions ({len(intr)})")
    ax_r.set_ylabel("rollout")
    ax_r.legend(loc="upper right", fontsize=8)
    lanes = [f"train rank {r}" for r in ranks] + [f"sync: {p}" for p in phases]
    for i, r in enumerate(ranks):
        bars = [(rel(s["start"]), s["end"] - s["start"]) for s in steps if s.get("rank", 0) == r]
        ax_l.broken_barh(bars, (i - 0.4, 0.8), color="tab:green")
    colors = plt.get_cmap("tab10")
    for j, p in enumerate(phases):
        bars = [(rel(s["start"]), s["end"] - s["start"]) for s in syncs if s.get("phase", "sync") == p]
        ax_l.broken_barh(bars, (len(ranks) + j - 0.4, 0.8), color=colors(3 + j % 7))
    whole = [s for s in syncs if s.get("phase") == "push"] or syncs  # shade each whole sync once
    for s in whole:
        for ax in (ax_r, ax_l):
            ax.axvspan(rel(s["start"]), rel(s["end"]), color="tab:orange", alpha=0.12, lw=0)
    ax_l.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax_l.set_ylim(-0.6, max(len(lanes), 1) - 0.4)
    ax_l.set_xlabel("seconds since the first event")
    ax_r.set_title("Timeline: rollout, training and weight syncs")
    fig.tight_layout()
    out = Path(out_png)
    try:
        with replaced(out) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
    return out


def draw_run_timeline(run_dir: str | os.PathLike) -> Optional[Path]:
    """<run_dir>/timeline.png from <run_dir>/events.jsonl (None when the run recorded no events)."""
    run_dir = Path(run_dir)
    return draw_timeline(run_dir / "events.jsonl", run_dir / "timeline.png")
