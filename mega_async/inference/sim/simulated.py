"""SimulatedEngine: a latency and interruption simulator with the `agenerate` interface.

No model runs: tokens and logprobs are random, but timing and the weight-update protocol are
modelled like a real server behind the AReaL client loop (pause aborts the chunk in flight,
partial tokens keep the version that produced them, generation resumes after continue under
the new version). Used by the executor's stress tests and overhead benchmark, never for training.
"""
from __future__ import annotations

import asyncio
import hashlib
import random
import threading
import time

from typing import Any, Optional

from mega_async.api.types import ModelRequest, ModelResponse, Version, WeightVersion

INTERRUPT_MODES = ("abort", "retract", "in_place")  # SGLang's /pause_generation modes


class SimulatedEngine:
    def __init__(
        self,
        vocab_size: int = 1000,
        min_new_tokens: int = 1,
        chunk_tokens: int = 8,
        token_latency: tuple[float, float] = (0.0, 0.0),  # seconds per token, uniform in [lo, hi]
        seed: int = 0,
        version: Optional[Version] = None,  # the run's (read); a standalone simulator has its own at 0
    ):
        if min_new_tokens < 1 or chunk_tokens < 1 or token_latency[0] < 0 or token_latency[1] < token_latency[0]:
            raise ValueError("SimulatedEngine needs min_new_tokens >= 1, chunk_tokens >= 1, 0 <= lo <= hi latency")
        self.vocab_size = vocab_size
        self.min_new_tokens = min_new_tokens
        self.chunk_tokens = chunk_tokens
        self.token_latency = token_latency
        self.seed = seed
        self._running = threading.Event()
        self._running.set()
        self._pause_epoch = 0
        self._version = version if version is not None else WeightVersion()
        self.interruptions = 0
        self.in_flight = 0

    # ---- weight-update protocol (called from the trainer thread) --------------------------
    def pause_generation(self, mode: str = "abort", timeout: float | None = None) -> None:
        """abort: the chunks in flight are cut; retract / in_place: they finish, nothing is cut. Either way
        requests wait until continue_generation."""
        if mode not in INTERRUPT_MODES:
            raise ValueError(f"pause mode {mode!r}: use one of {INTERRUPT_MODES}")
        self._running.clear()
        if mode == "abort":
            self._pause_epoch += 1

    async def wait_idle(self, timeout: float) -> None:
        """Until no request is in flight (rollout.interrupt=none lets generation finish before the pause)."""
        deadline = time.monotonic() + timeout
        while self.in_flight:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.in_flight} requests still in flight after {timeout:g}s")
            await asyncio.sleep(0.001)

    async def abort_in_flight(self, timeout: float) -> int:
        """Nothing to abort ahead: the abort pause cuts the chunks in flight at once, with no wait of its own."""
        return self.in_flight

    def continue_generation(self, timeout: Optional[float] = None) -> None:
        self._running.set()

    @property
    def version(self) -> int:
        return self._version.value

    # the rest of the InferenceEngine protocol: one in-process "server" that is always up and serves the run's
    # version (it reads the shared version, so a weight sync has nothing to send it)
    def pause(self) -> None:
        """Requests wait in agenerate while paused: nothing to hold on this side."""

    def resume(self) -> None:
        pass

    def settle(self, timeout: float) -> int:
        return 0

    def update_weights_from_disk(self, path: str, version: Any, **_: Any) -> None:
        """No model to load: the tokens generated after continue carry the version the sync set."""

    @property
    def addresses(self) -> list[str]:
        return []

    def sync_targets(self) -> list:
        return []

    async def learn_releases(self, timeout: Optional[float] = None) -> list:
        return []

    async def probe_down(self) -> None:
        pass

    async def find_behind(self, timeout: float = 10.0) -> list[str]:
        return []

    def synced(self, version: Any) -> None:
        pass

    async def rollback_weights(self, timeout: Optional[float] = None, addresses: Optional[list] = None) -> list:
        return []

    @property
    def silent(self) -> list[str]:
        """No server to go silent."""
        return []

    # ---- generation --------------------------------------------------------------------------
    async def _wait_running(self) -> None:
        while not self._running.is_set():
            await asyncio.sleep(0.001)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        t0 = time.monotonic()
        seed = int.from_bytes(hashlib.blake2b(f"{self.seed}:{req.rid}".encode(), digest_size=8).digest(), "little")
        rng = random.Random(seed)
        target = rng.randint(min(self.min_new_tokens, req.max_new_tokens), req.max_new_tokens)
        resp = ModelResponse(input_tokens=list(req.input_ids))
        stop = set(req.stop_token_ids)
        lo, hi = self.token_latency
        self.in_flight += 1
        try:
            while len(resp.output_tokens) < target:
                await self._wait_running()
                epoch, version = self._pause_epoch, self._version.value
                k = min(self.chunk_tokens, target - len(resp.output_tokens))
                await asyncio.sleep(rng.uniform(lo, hi) * k if hi > 0 else 0)
                if epoch != self._pause_epoch:  # aborted mid-chunk: keep what was produced so far
                    k = rng.randint(0, k)
                    resp.num_interruptions += 1
                    self.interruptions += 1
                for _ in range(k):
                    tok = rng.randrange(self.vocab_size)
                    resp.output_tokens.append(tok)
                    resp.output_logprobs.append(-rng.expovariate(1.0))
                    resp.output_versions.append(version)
                    if tok in stop and not req.ignore_eos:
                        resp.stop_reason = "stop"
                        return resp
            resp.stop_reason = "length"
            return resp
        finally:
            self.in_flight -= 1
            resp.latency = time.monotonic() - t0
