"""The simulated model of a fleet server: how long a request runs and what it answers. Pure, no I/O, no torch.

Lengths are long-tailed as in RL runs (lognormal around `length_median`, capped at the request's
max_new_tokens); a running request makes one token every `token_latency_s + batch_latency_s * b` seconds,
b = the server's running batch. Token ids come from a seeded pool; each token's logprob encodes the weight
version that produced it (`version_of_logprob`), so a client's per-token version labels can be checked
against what the server really did.
"""
from __future__ import annotations

import array
import asyncio
import itertools
import math
import time
import random
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

try:
    import orjson

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover - orjson is optional
    import json

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

POOL_SIZE = 1 << 16
ENTRY_TABLES = 8  # versions whose logprob entries are kept serialized (~4 MB each)


@dataclass
class FleetConfig:
    """One fleet's servers (all alike). Times in seconds; `time_scale` divides every latency."""

    seed: int = 0
    length_median: float = 256.0  # tokens (lognormal median)
    length_sigma: float = 1.0  # lognormal sigma: 1.0 gives a long tail (p99 ~ 10x the median)
    min_new_tokens: int = 1
    token_latency_s: float = 0.02  # per token at batch size 1
    batch_latency_s: float = 5e-5  # added per token for every running request of the server
    ttft_s: float = 0.05  # prefill, counted once per admission (again after a retract)
    max_running_requests: int = 256  # more wait in the server's queue, as SGLang's
    vocab_size: int = 32000
    sglang_version: str = "0.5.23"  # the release whose protocol is spoken (sessions since 0.5.21)
    weight_version: str = "0"  # at start and after a restart (a restarted server has its launch weights)
    load_s: float = 0.2  # /update_weights_from_disk (a timed no-op)
    init_group_s: float = 0.01  # /init_weights_update_group (a timed no-op: no group is joined)
    bucket_s: float = 0.001  # per /update_weights_from_distributed bucket, plus its bytes at bandwidth
    bandwidth_gbps: float = 100.0  # GB/s of the simulated broadcast
    pause_poll_s: float = 0.0  # SGLang 0.5.23's abort pause polls its lock every 1.0 s; 0 = answer at once
    keepalive_s: float = 5.0  # idle keep-alive connections are closed after this (uvicorn's default)
    data_plane: str = "none"  # no torch.distributed group is ever joined: weights are not received
    api_key: Optional[str] = None
    time_scale: float = 1.0  # >1 runs every latency that many times faster

    def __post_init__(self) -> None:
        problems = [f"{f}={getattr(self, f)!r} must be > 0" for f in ("length_median", "time_scale", "bandwidth_gbps")
                    if not getattr(self, f) > 0]
        problems += [f"{f}={getattr(self, f)!r} must be >= 0" for f in (
            "length_sigma", "token_latency_s", "batch_latency_s", "ttft_s", "load_s", "init_group_s", "bucket_s",
            "pause_poll_s") if not getattr(self, f) >= 0]
        if self.max_running_requests < 1 or self.min_new_tokens < 0 or self.vocab_size < 2:
            problems.append("max_running_requests >= 1, min_new_tokens >= 0 and vocab_size >= 2 are needed")
        if self.token_latency_s + self.batch_latency_s <= 0:
            problems.append("token_latency_s + batch_latency_s must be > 0 (tokens need time)")
        if self.data_plane != "none":
            problems.append(f"data_plane={self.data_plane!r}: the fleet has no data plane; use none")
        if problems:
            raise ValueError("FleetConfig: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FleetConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"FleetConfig: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**d)

    def seconds(self, s: float) -> float:
        return s / self.time_scale


def version_number(v: Any) -> int:
    """A weight version as the integer the logprobs encode (non-numeric versions: a stable small hash)."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return sum(map(ord, str(v))) % 997


def logprob_for(version: int, u: float) -> float:
    """The logprob of a token made at `version` (u in [0, 1) gives it some spread)."""
    return -(version + 0.25 + 0.5 * u)


def version_of_logprob(lp: float) -> int:
    """The version a fleet token's logprob encodes (inverse of `logprob_for`)."""
    return int(math.floor(-lp))


class TokenModel:
    """Seeded token ids, logprob spreads and lengths, shared by every server of a process."""

    def __init__(self, cfg: FleetConfig):
        rng = random.Random(cfg.seed)
        self.cfg = cfg
        self.ids = [rng.randrange(cfg.vocab_size) for _ in range(POOL_SIZE)]
        self.spread = [rng.random() for _ in range(POOL_SIZE)]
        self._mu = math.log(cfg.length_median)
        self._tables: dict[int, tuple[bytes, array.array]] = {}  # version -> the pool's entries as JSON

    def length(self, key: int) -> int:
        """Tokens a fresh request means to make before its stop token (lognormal, seeded by the prompt); a request
        whose max_new_tokens is smaller finishes by length."""
        rng = random.Random(key ^ (self.cfg.seed * 0x9E3779B97F4A7C15))
        n = int(rng.lognormvariate(self._mu, self.cfg.length_sigma)) if self.cfg.length_sigma else int(
            self.cfg.length_median)
        return max(self.cfg.min_new_tokens, n, 1)

    def offset(self, key: int) -> int:
        return (key * 2654435761) % POOL_SIZE

    def tokens(self, offset: int, n: int) -> list[int]:
        o = offset % POOL_SIZE
        if o + n <= POOL_SIZE:
            return self.ids[o:o + n]
        return [self.ids[(o + i) % POOL_SIZE] for i in range(n)]

    def logprob_json(self, offset: int, ids: list[int], versions: list[tuple[int, int, int]]) -> bytes:
        """SGLang's output_token_logprobs, [[logprob, token id, null], ...] over spans (start, end, version), as
        JSON text. Each span is one slice of its version's table (built once, the last few versions kept): an
        abort pause answers thousands of partial outputs at once, and building and serializing every entry
        anew was 70% of the fleet's CPU there, joining them entry by entry still 18%. A token that is not the
        pool's (the stop token put last) gets its own entry."""
        spans, tail = [(a, b, v) for a, b, v in versions if b > a], b""
        if spans:
            a, b, v = spans[-1]
            last = (offset + b - 1) % POOL_SIZE
            if ids[b - 1] != self.ids[last]:
                tail = dumps([logprob_for(v, self.spread[last]), ids[b - 1], None])
                spans[-1] = (a, b - 1, v)
        parts: list[bytes] = []
        for a, b, v in spans:
            if b > a:  # the stop token's own span may be empty now
                text, starts = self._entry_table(v)
                o = (offset + a) % POOL_SIZE  # the table holds the pool twice: a span past its end is one slice
                parts.append(text[starts[o]:starts[o + b - a] - 1])
        if tail:
            parts.append(tail)
        return b"[" + b",".join(parts) + b"]"

    def warm(self, version: Any) -> None:
        """Build `version`'s table now (at start-up: else the first answers, maybe a pause's, pay for it)."""
        self._entry_table(version_number(version))

    def _entry_table(self, version: int) -> tuple[bytes, array.array]:
        """The pool's entries at `version`, twice over, as JSON text each followed by a comma, and where each one
        starts (one start past the end too: entry i is text[starts[i]:starts[i + 1] - 1])."""
        table = self._tables.get(version)
        if table is None:
            sp, ids = self.spread, self.ids
            entries = [dumps([logprob_for(version, sp[i]), ids[i], None]) + b"," for i in range(POOL_SIZE)] * 2
            table = self._tables[version] = (b"".join(entries),
                                             array.array("q", itertools.accumulate(map(len, entries), initial=0)))
            while len(self._tables) > ENTRY_TABLES:  # the oldest version first (dicts keep insertion order)
                del self._tables[next(iter(self._tables))]
        return table

    def token_latency(self, batch: int, slow: float = 1.0) -> float:
        """Seconds per token for each running request when `batch` run together."""
        c = self.cfg
        return c.seconds(c.token_latency_s + c.batch_latency_s * batch) * slow


class BadRequest(Exception):
    """Answered 400 with SGLang's handler error body {"error": {"message"}}."""


class SimRequest:
    __slots__ = ("rid", "input_ids", "planned", "target", "stop", "offset", "base", "p0", "gen", "running",
                 "marks", "fut", "t0", "cached", "logprobs")

    def __init__(self, rid: str, input_ids: list, planned: int, target: int, stop: Optional[int], offset: int,
                 version: str, cached: int, logprobs: bool, fut: asyncio.Future):
        self.rid, self.input_ids, self.planned, self.target, self.stop = rid, input_ids, planned, target, stop
        self.offset, self.cached, self.logprobs, self.fut = offset, cached, logprobs, fut
        self.base = 0  # tokens made before the current admission (a retracted request keeps them)
        self.p0 = 0.0  # the progress clock from which this admission counts tokens
        self.gen = 0  # admissions so far: heap entries of earlier ones are stale
        self.running = False
        self.marks: list[list] = [[0, version]]  # [first token index, weight version] in order
        self.t0 = time.monotonic()

    def mark(self, produced: int, version: str) -> None:
        if self.marks[-1][0] == produced:
            self.marks[-1][1] = version
        elif self.marks[-1][1] != version:
            self.marks.append([produced, version])
