"""A fleet of protocol-true simulated SGLang servers: a test and benchmark tool, never for training.

    python -m mega_async.inference.sim.fleet --num-servers 256 --procs 2 --addresses-file fleet.txt

Each server speaks the HTTP surface our client and sync use (/generate with SGLang's meta_info, pause modes,
sessions, weight-update control messages, health, server_info) over a timed model (fleet/model.py); only the
model is simulated. Many servers share one asyncio process (no torch import), so hundreds fit on two cores.
Servers fail on a seedable schedule (fleet/schedule.py) or by hand (`Fleet.fail`).

`Fleet(n, cfg)` starts the fleet (worker processes, or one thread with `in_thread=True` for cheap tests) and
gives its `addresses`; `fail`, `recover` and `state` talk to the workers' admin endpoints.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional, Sequence

from mega_async.inference.sim.fleet.model import FleetConfig, version_of_logprob  # noqa: F401 (public)
from mega_async.inference.sim.fleet.schedule import (FailureEvent, dump_schedule, load_schedule,  # noqa: F401
                                                 parse_schedule, random_schedule)

logger = logging.getLogger("mega_async.inference.sim.fleet")


def split(n: int, parts: int) -> list[list[int]]:
    """Server indices 0..n-1 in `parts` contiguous slices as even as possible."""
    parts = max(1, min(parts, n))
    return [list(range(n * k // parts, n * (k + 1) // parts)) for k in range(parts)]


class Fleet:
    """N simulated servers in `procs` worker processes (or one thread of this process with `in_thread`)."""

    def __init__(self, num_servers: int, config: Optional[FleetConfig] = None, *, procs: int = 1,
                 host: str = "127.0.0.1", base_port: Optional[int] = None, schedule: Sequence[FailureEvent] = (),
                 in_thread: bool = False, log_dir: Optional[str] = None, startup_timeout: float = 120.0):
        if num_servers < 1:
            raise ValueError(f"a fleet needs at least one server, got num_servers={num_servers}")
        bad = [e for e in schedule if e.server >= num_servers]
        if bad:
            raise ValueError(f"failure event for server {bad[0].server}, but the fleet has {num_servers} servers")
        self.num_servers, self.cfg, self.host, self.base_port = num_servers, config or FleetConfig(), host, base_port
        self.procs, self.in_thread, self.schedule = (1 if in_thread else procs), in_thread, list(schedule)
        self.log_dir, self.startup_timeout = log_dir, startup_timeout
        self.addresses: list[str] = []
        self._admin: dict[int, str] = {}  # server index -> its process's admin address
        self._workers: list[subprocess.Popen] = []
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._host_obj: Any = None
        self.epoch = 0.0

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> list[str]:
        self.epoch = time.time()
        slices = split(self.num_servers, self.procs)
        if self.in_thread:
            self._start_thread(slices[0])
        else:
            self._start_workers(slices)
        logger.info("fleet of %d simulated servers up (%d processes)", self.num_servers, len(slices))
        return self.addresses

    def _ports(self, indices: list[int]) -> Optional[list[int]]:
        return None if self.base_port is None else [self.base_port + i for i in indices]

    def _start_thread(self, indices: list[int]) -> None:
        from mega_async.inference.sim.fleet.host import FleetHost

        ready = threading.Event()
        error: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                self._host_obj = FleetHost(self.cfg, indices, self.host, self._ports(indices), self.schedule, self.epoch)
                loop.run_until_complete(self._host_obj.start())
            except BaseException as e:  # noqa: BLE001 - re-raised in start()
                error.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._host_obj.stop())
            loop.close()

        self._thread = threading.Thread(target=main, name="fleet", daemon=True)
        self._thread.start()
        if not ready.wait(self.startup_timeout) or error:
            raise RuntimeError(f"the fleet did not start: {error[0] if error else 'timeout'}")
        self.addresses = self._host_obj.addresses
        admin = f"{self.host}:{self._host_obj.admin_port}"
        self._admin = {i: admin for i in indices}

    def _start_workers(self, slices: list[list[int]]) -> None:
        sched = json.dumps(dump_schedule(self.schedule))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[4])] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
        for k, indices in enumerate(slices):
            cmd = [sys.executable, "-m", "mega_async.inference.sim.fleet", "--worker", "--servers",
                   f"{indices[0]}:{indices[-1] + 1}", "--host", self.host, "--config-json",
                   json.dumps(self.cfg.to_dict()), "--schedule-json", sched, "--epoch", repr(self.epoch)]
            if self.base_port is not None:
                cmd += ["--base-port", str(self.base_port)]
            err = open(Path(self.log_dir) / f"fleet{k}.log", "ab") if self.log_dir else subprocess.DEVNULL
            self._workers.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env))
        deadline = time.monotonic() + self.startup_timeout
        addresses: dict[int, str] = {}
        try:
            for k, (p, indices) in enumerate(zip(self._workers, slices)):
                line = _read_line(p, deadline)
                if not line:
                    raise RuntimeError(f"fleet worker {k} exited with {p.poll()} before it was ready"
                                       + (f"; see {self.log_dir}/fleet{k}.log" if self.log_dir else ""))
                info = json.loads(line)
                addresses.update(zip(indices, info["addresses"]))
                self._admin.update({i: info["admin"] for i in indices})
        except BaseException:
            self.stop()
            raise
        self.addresses = [addresses[i] for i in range(self.num_servers)]

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread, self._loop = None, None
        for p in self._workers:
            if p.poll() is None:
                p.terminate()
        for p in self._workers:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._workers = []

    def __enter__(self) -> "Fleet":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- admin ---------------------------------------------------------------------------------
    def _call(self, admin: str, path: str, body: Optional[dict] = None, timeout: float = 30.0) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://{admin}{path}", data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def fail(self, server: int, kind: str, duration: Optional[float] = None, factor: float = 10.0,
             status: int = 503) -> dict:
        """Fail one server now (crash, hang, slow, error), for `duration` seconds or for good."""
        FailureEvent(server, 0.0, kind, duration, factor, status)  # validates
        return self._call(self._admin[server], "/fleet/fail", {"server": server, "kind": kind, "duration": duration,
                                                                "factor": factor, "status": status})

    def recover(self, server: int, kind: Optional[str] = None) -> dict:
        """End a server's failure now (a crashed one restarts as a new process at its launch version)."""
        return self._call(self._admin[server], "/fleet/recover", {"server": server, "kind": kind})

    def state(self) -> list[dict]:
        """Every server's state and counters (received, requests, finished, aborted, tokens, buckets, crashes...)."""
        out: list[dict] = []
        for admin in dict.fromkeys(self._admin.values()):
            out += self._call(admin, "/fleet/state")
        return sorted(out, key=lambda s: s["index"])


def _read_line(p: subprocess.Popen, deadline: float) -> bytes:
    """The worker's ready line (its stdout), or b'' when it exits or the deadline passes."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    buf = b""
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return b""
            chunk = os.read(p.stdout.fileno(), 1 << 16)
            if not chunk:
                return b""
            buf += chunk
    finally:
        sel.close()
    return buf.split(b"\n", 1)[0]
