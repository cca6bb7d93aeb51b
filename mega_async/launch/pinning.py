"""Disjoint CPU sets for the inference servers and the trainer on one host, as a cluster gives them separate
GPUs: without it, generation and training fight for the same cores and the overlap asynchronous training
exists for is hidden.

    mega-async pin [--cpus 0-15] -- train -c configs/addition_rl_cpu.yaml ...

The allowed CPUs (default: this process's affinity) are split in two equal halves: the servers get the first,
the trainer (this process, its trainer ranks, reward workers, the rollout executor) the second. The trainer is
pinned before anything starts; a watcher thread pins every thread of each server process the run launches
(`mega_async.server` or `sglang`) as soon as it appears, then keeps re-pinning new threads. Thread
counts follow: the run sizes its pools from os.cpu_count() (the trainer runs cores / (2 x ranks) torch threads
per rank, each server cores / 2 / servers: mega_async.run.loop, mega_async.inference.service), and in this process
os.cpu_count() answers the number of CPUs split, so each pool is the size of its half. Trainer ranks that a
multi-rank run starts as new processes see the machine's count instead: pin one-rank runs, or all CPUs.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from typing import Callable, Iterable, Optional, Sequence

logger = logging.getLogger("mega_async.launch.pinning")

SERVER_MARKERS = ("mega_async.server", "sglang.launch_server", "mega_async.inference.sglang.entry")


def parse_cpus(spec: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]; ValueError (one line) on anything else."""
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and (not hi.isdigit() or int(hi) < int(lo))):
            raise ValueError(f"CPU list {spec!r}: {part!r} is not N or N-M (example: 0-3,8)")
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def split_cpus(cpus: Sequence[int]) -> tuple[list[int], list[int]]:
    """(server CPUs, trainer CPUs): two equal halves of an even number of CPUs, servers first."""
    cpus = sorted(set(cpus))
    if len(cpus) < 2 or len(cpus) % 2:
        raise ValueError(f"pinning splits the CPUs in two equal halves: got {len(cpus)} ({cpus}); pass an even "
                         "number >= 2 with --cpus")
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]


def pin_threads(pid: int, cpus: Iterable[int]) -> int:
    """Every thread of `pid` onto `cpus` (sched_setaffinity is per thread); returns how many were pinned."""
    cpus = set(cpus)
    n = 0
    for tid in _tids(pid):
        try:
            if os.sched_getaffinity(tid) != cpus:
                os.sched_setaffinity(tid, cpus)
            n += 1
        except (ProcessLookupError, PermissionError, OSError):
            pass  # the thread ended in between
    return n


def _tids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []


def is_server(cmdline: Sequence[str]) -> bool:
    return any(m in arg for arg in cmdline for m in SERVER_MARKERS)


class ServerPinner:
    """A thread that pins the server processes among this process's descendants to `cpus` (every `interval`
    seconds, so threads a server starts later are pinned too). `pinned` maps server pid -> thread count."""

    def __init__(self, cpus: Sequence[int], interval: float = 0.2, root: Optional[int] = None):
        self.cpus, self.interval = list(cpus), interval
        self.root = root or os.getpid()
        self.pinned: dict[int, int] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="server-pinner", daemon=True)

    def poll(self) -> None:
        import psutil

        try:
            kids = psutil.Process(self.root).children(recursive=True)
        except psutil.Error:
            return
        for p in kids:
            try:
                if is_server(p.cmdline()):
                    n = pin_threads(p.pid, self.cpus)
                    if p.pid not in self.pinned:
                        logger.info("pinned server pid %d (%d threads) to CPUs %s", p.pid, n, self.cpus)
                    self.pinned[p.pid] = n
            except psutil.Error:
                pass

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)

    def __enter__(self) -> "ServerPinner":
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def main(argv: Sequence[str], run: Callable[[list[str]], int]) -> int:
    """`mega-async pin [--cpus LIST] -- COMMAND ...`: pin, then `run(COMMAND ...)` (the CLI) in this process."""
    argv = list(argv)
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else ([], argv)
    ap = argparse.ArgumentParser(prog="mega-async pin", description=__doc__.splitlines()[0])
    ap.add_argument("--cpus", default=None, help="CPUs to split (default: this process's affinity), e.g. 0-15")
    a = ap.parse_args(ours)
    if not rest:
        ap.error("name the mega-async command after --, e.g. -- train -c configs/addition_rl_cpu.yaml")
    try:
        cpus = parse_cpus(a.cpus) if a.cpus else sorted(os.sched_getaffinity(0))
        servers, trainer = split_cpus(cpus)
    except ValueError as e:
        print(f"mega-async pin: {e}", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, trainer)  # before torch starts its thread pools; children inherit it
    os.cpu_count = lambda: len(cpus)  # type: ignore[assignment] # the pools the run sizes from it fit the halves
    print(f"mega-async pin: servers on CPUs {servers}, trainer on CPUs {trainer}", file=sys.stderr, flush=True)
    with ServerPinner(servers):
        return run(rest)
