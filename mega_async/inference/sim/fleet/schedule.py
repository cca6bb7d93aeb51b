"""Failure schedules of a fleet: which server fails how, when, for how long. Pure, seedable, JSON.

A schedule is a list of events, each `{"server": i, "at": s, "kind": k, "duration": s | null, ...}`
(`at` in seconds after the fleet started; `duration` null = for good):

- crash: the server stops answering and closes its port; open connections are reset. With a duration it
  comes back after it, as a restarted process: its launch weights and version, no weight-update group, no
  session, an empty cache.
- hang: connections are accepted but nothing is answered (not /health either) and generation stops; with a
  duration, everything held is answered after it.
- slow: every token takes `factor` times longer (default 10).
- error: every endpoint but /health answers `status` (default 503) with SGLang's error body.

    {"events": [{"server": 3, "at": 12.5, "kind": "crash", "duration": 30},
                {"server": 7, "at": 20, "kind": "hang", "duration": null}]}

`random_schedule` draws one: a fraction of the servers per kind, each at a uniform moment of a window.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

KINDS = ("crash", "hang", "slow", "error")


@dataclass(frozen=True)
class FailureEvent:
    server: int
    at: float
    kind: str
    duration: Optional[float] = None  # None: for good
    factor: float = 10.0  # slow
    status: int = 503  # error

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"failure kind {self.kind!r}: use one of {KINDS}")
        if self.server < 0 or self.at < 0 or (self.duration is not None and self.duration <= 0):
            raise ValueError(f"failure event {self}: server >= 0, at >= 0 and duration > 0 (or null) are needed")
        if self.kind == "slow" and self.factor <= 0:
            raise ValueError(f"failure event {self}: a slow factor must be > 0")
        if self.kind == "error" and not 500 <= self.status <= 599:
            raise ValueError(f"failure event {self}: an error status is a 5xx")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_schedule(obj: Any) -> list[FailureEvent]:
    """Events from JSON data: `{"events": [...]}` or a bare list."""
    items = obj.get("events") if isinstance(obj, dict) else obj
    if not isinstance(items, list):
        raise ValueError('a failure schedule is {"events": [...]} or a list of events')
    out = []
    for i, e in enumerate(items):
        if not isinstance(e, dict):
            raise ValueError(f"failure event {i} is not an object: {e!r}")
        unknown = set(e) - {"server", "at", "kind", "duration", "factor", "status"}
        if unknown:
            raise ValueError(f"failure event {i} has unknown keys {sorted(unknown)}")
        try:
            out.append(FailureEvent(int(e["server"]), float(e["at"]), str(e["kind"]),
                                    None if e.get("duration") is None else float(e["duration"]),
                                    float(e.get("factor", 10.0)), int(e.get("status", 503))))
        except KeyError as k:
            raise ValueError(f"failure event {i} lacks {k}") from None
    return sorted(out, key=lambda e: (e.at, e.server))


def load_schedule(path: str | Path) -> list[FailureEvent]:
    return parse_schedule(json.loads(Path(path).read_text()))


def dump_schedule(events: Sequence[FailureEvent]) -> dict[str, Any]:
    return {"events": [e.to_dict() for e in events]}


def random_schedule(num_servers: int, seed: int, window: tuple[float, float], fractions: dict[str, float],
                    duration: Optional[tuple[float, float]] = None) -> list[FailureEvent]:
    """round(fraction * num_servers) distinct servers per kind (a server fails once at most), each at a uniform
    moment of `window`; `duration` (lo, hi) draws how long, None = for good."""
    unknown = set(fractions) - set(KINDS)
    if unknown:
        raise ValueError(f"failure kinds {sorted(unknown)}: use {KINDS}")
    if sum(fractions.values()) > 1 + 1e-9 or any(f < 0 for f in fractions.values()):
        raise ValueError(f"failure fractions {fractions} must be >= 0 and sum to at most 1")
    rng = random.Random(seed)
    order = list(range(num_servers))
    rng.shuffle(order)
    out, k = [], 0
    for kind in KINDS:
        n = round(fractions.get(kind, 0.0) * num_servers)
        for s in order[k:k + n]:
            d = None if duration is None else rng.uniform(*duration)
            out.append(FailureEvent(s, rng.uniform(*window), kind, d))
        k += n
    return sorted(out, key=lambda e: (e.at, e.server))


def parse_fractions(spec: str) -> dict[str, float]:
    """'crash=0.1,hang=0.05' -> {'crash': 0.1, 'hang': 0.05}."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, value = part.partition("=")
        try:
            out[kind.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--failures {spec!r}: write kind=fraction pairs, e.g. crash=0.1,hang=0.05") from None
    return out
