"""`python -m mega_async.inference.sim.fleet --num-servers 256 ...`: start a fleet, print its addresses, serve until
Ctrl-C / SIGTERM. Every FleetConfig field is a flag (--length-median, --token-latency-s, --sglang-version, ...).

    python -m mega_async.inference.sim.fleet --num-servers 64 --procs 2 --addresses-file /tmp/fleet.txt \\
        --failures crash=0.1,hang=0.05 --failure-window 10,60 --failure-duration 5,20 --failure-seed 7
    python -m mega_async.inference.sim.fleet --num-servers 8 --schedule my_failures.json
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import typing

from mega_async.inference.sim.fleet import Fleet
from mega_async.inference.sim.fleet.model import FleetConfig
from mega_async.inference.sim.fleet.schedule import (dump_schedule, load_schedule, parse_fractions, parse_schedule,
                                                 random_schedule)


def _pair(s: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: give two numbers, lo,hi") from None
    if not 0 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{s!r}: need 0 <= lo <= hi")
    return lo, hi


def _config_flags(ap: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(FleetConfig)
    for f in dataclasses.fields(FleetConfig):
        kind = hints[f.name]
        conv = {int: int, float: float, str: str}.get(kind, str)
        ap.add_argument("--" + f.name.replace("_", "-"), dest=f"cfg_{f.name}", type=conv, default=None,
                        help=f"FleetConfig.{f.name} (default {f.default!r})")


def config_from(args: argparse.Namespace) -> FleetConfig:
    d = json.loads(args.config_json) if args.config_json else {}
    d.update({f.name: getattr(args, f"cfg_{f.name}") for f in dataclasses.fields(FleetConfig)
              if getattr(args, f"cfg_{f.name}") is not None})
    return FleetConfig.from_dict(d)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mega_async.inference.sim.fleet", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--num-servers", type=int, default=8)
    ap.add_argument("--procs", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 2)),
                    help="worker processes the servers are spread over")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--base-port", type=int, default=None, help="server i listens on base+i (default: any free port)")
    ap.add_argument("--addresses-file", default=None, help="write host:port lines here once every server is up")
    ap.add_argument("--schedule", default=None, help='failure schedule JSON file ({"events": [...]})')
    ap.add_argument("--failures", default=None, help="draw a schedule: kind=fraction pairs, e.g. crash=0.1,hang=0.05")
    ap.add_argument("--failure-window", type=_pair, default=(10.0, 60.0), help="lo,hi seconds after start")
    ap.add_argument("--failure-duration", type=_pair, default=None, help="lo,hi seconds (default: for good)")
    ap.add_argument("--failure-seed", type=int, default=0)
    ap.add_argument("--config-json", default=None, help="FleetConfig fields as JSON (flags override)")
    ap.add_argument("--log-level", default="WARNING")
    ap.add_argument("--log-dir", default=None, help="each worker process logs to <dir>/fleet<k>.log")
    # worker mode (started by Fleet): serve a slice of the servers, print one JSON ready line
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--servers", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--schedule-json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--epoch", type=float, default=None, help=argparse.SUPPRESS)
    _config_flags(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from(args)
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    if args.worker:
        return worker(args, cfg)
    if args.schedule and args.failures:
        ap.error("give --schedule or --failures, not both")
    try:
        events = load_schedule(args.schedule) if args.schedule else []
        if args.failures:
            events = random_schedule(args.num_servers, args.failure_seed, args.failure_window,
                                     parse_fractions(args.failures), args.failure_duration)
        fleet = Fleet(args.num_servers, cfg, procs=args.procs, host=args.host, base_port=args.base_port,
                      schedule=events, log_dir=args.log_dir)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    fleet.start()
    try:
        if args.addresses_file:
            tmp = f"{args.addresses_file}.tmp"
            with open(tmp, "w") as f:
                f.write("\n".join(fleet.addresses) + "\n")
            os.replace(tmp, args.addresses_file)
        print(json.dumps({"addresses": fleet.addresses, "schedule": dump_schedule(events)["events"]}), flush=True)
        stop.wait()
    finally:
        fleet.stop()


def worker(args: argparse.Namespace, cfg: FleetConfig) -> None:
    from mega_async.inference.sim.fleet.host import FleetHost

    a, b = (int(x) for x in args.servers.split(":"))
    indices = list(range(a, b))
    ports = None if args.base_port is None else [args.base_port + i for i in indices]
    events = parse_schedule(json.loads(args.schedule_json)) if args.schedule_json else []
    parent = os.getppid()

    async def run() -> None:
        host = FleetHost(cfg, indices, args.host, ports, events, args.epoch)
        host.tokens.warm(cfg.weight_version)  # before serving: else the first answers (maybe a pause's) build it
        await host.start()
        sys.stdout.write(json.dumps({"addresses": host.addresses, "admin": f"{args.host}:{host.admin_port}"}) + "\n")
        sys.stdout.flush()
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, done.set)
        while not done.is_set() and os.getppid() == parent:  # the supervisor died: so do we
            try:
                await asyncio.wait_for(done.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        await host.stop()

    asyncio.run(run())


if __name__ == "__main__":
    main()
