"""One trainer rank and two embedded servers; a server is stopped (SIGSTOP) during a weight sync, then continued
(SIGCONT). Writes JSON. Run by tests/integration/test_sync_hang.py.

    pause   server 0 is stopped as the sync pauses the servers (its /pause_generation never answers), with long
            requests in flight on both servers
    bucket  then server 1 is stopped after the sync's first bucket (its reply and its receive never come)

Each time the sync must go on with the other server within about trainer.sync_timeout, every warning naming the
stopped server and the phase, the requests in flight on it must finish on the other one, and after SIGCONT the next
sync must bring it to the current version.
"""
import argparse
import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import threading
import time

import torch

from mega_async.inference.client import SGLangClient
from mega_async.inference.servers import ServerLauncher, ServerSpec
from mega_async.trainer.model import build_model
from mega_async.trainer.parallel import destroy_parallel_state
from mega_async.trainer.sync import distributed_sync, RolloutSide, SyncError
from mega_async.api.types import ModelRequest, WeightVersion

PROBE = [3, 14, 15, 92, 65, 35]


class Lines(logging.Handler):
    """Every warning the sync and the client log, with its time."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.monotonic(), record.getMessage()))


def probe(client: SGLangClient, i: int) -> dict:
    out = asyncio.run(client.generate_on(i, {"input_ids": PROBE, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}, timeout=60))
    info = asyncio.run(client._request("GET", client.servers[i], "/model_info", timeout=60))[1]
    return {"tokens": out["output_ids"], "version": info["weight_version"]}


def step(models) -> None:
    with torch.no_grad():  # a "training step": the new version differs
        for p in models[0].parameters():
            p.add_(0.05 * torch.randn_like(p))


def push(sync, result: dict, key: str) -> None:
    t0 = time.monotonic()
    try:
        sync.push()
        result[key] = {"error": None}
    except SyncError as e:
        result[key] = {"error": str(e)}
    result[key]["end"] = time.monotonic()
    result[key]["s"] = result[key]["end"] - t0
    result[key]["version"] = sync.version.value


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--logs", required=True)
    args = ap.parse_args()
    lines = Lines()
    logging.getLogger("mega_async").addHandler(lines)
    launchers = [ServerLauncher(ServerSpec("embedded", args.model, num_servers=1, num_threads=1,
                                           extra_args=["--weight-update-timeout", "20"]),
                                log_dir=f"{args.logs}/s{i}", startup_timeout=120) for i in range(2)]
    result: dict = {}
    pool = concurrent.futures.ThreadPoolExecutor(len(launchers))
    stopped: dict[int, float] = {}
    try:
        starting = [pool.submit(launcher.start) for launcher in launchers]  # both boot while the model is built
        models = build_model(args.model, "megatron:d1", load_weights=True)
        addresses = [a for f in starting for a in f.result()]
        version = WeightVersion()
        client = SGLangClient(addresses, version=version, health_check_interval=0.2, request_timeout=120)
        result["addresses"] = client.addresses
        sync = distributed_sync(models, version, RolloutSide(client), addresses, bucket_bytes=64 << 10,
                                     timeout=args.timeout)

        def stop(i: int) -> None:
            if i not in stopped:
                os.kill(launchers[i].procs[0].pid, signal.SIGSTOP)
                stopped[i] = time.monotonic()

        # -- pause: server 0 stops as the servers are paused, with requests in flight on both ---------------------
        responses: list = []
        reqs = [ModelRequest(input_ids=PROBE[:3 + i % 3], max_new_tokens=150, ignore_eos=True) for i in range(6)]

        def generate() -> None:
            async def all_requests() -> list:
                return list(await asyncio.gather(*(client.agenerate(r) for r in reqs)))
            try:
                responses.extend(asyncio.run(all_requests()))
            except BaseException as e:  # noqa: BLE001 - reported
                result["generate_error"] = repr(e)
            result["generate_done"] = time.monotonic()

        t = threading.Thread(target=generate)
        t.start()
        deadline = time.monotonic() + 60
        while min(s.in_flight for s in client.servers) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)  # requests on both servers
        pause = client.pause_generation

        def stopping_pause(*a, **kw):
            stop(0)
            return pause(*a, **kw)

        client.pause_generation = stopping_pause
        step(models)
        push(sync, result, "pause")
        client.pause_generation = pause
        t.join(150)
        result["pause"]["detect_s"] = result["pause"]["end"] - stopped[0]  # stop -> the sync done without it
        result["pause"]["requests"] = [{"n": len(r.output_tokens), "stop": r.stop_reason} for r in responses]
        result["pause"]["requests_done_s"] = result.get("generate_done", float("inf")) - stopped[0]
        result["pause"]["served"] = probe(client, 1)
        os.kill(launchers[0].procs[0].pid, signal.SIGCONT)
        step(models)
        push(sync, result, "pause_back")
        asyncio.run(client.probe_down())  # re-admitted once its version is the run's
        result["pause_back"]["served"] = [probe(client, i) for i in range(2)]
        result["pause_back"]["healthy"] = [s.healthy for s in client.servers]

        # -- bucket: server 1 stops after the first bucket ---------------------------------------------------------
        buckets = sync.transport.resharder.buckets

        def stopping_buckets():
            for k, b in enumerate(buckets()):
                if k == 1:
                    stop(1)
                yield b

        sync.transport.resharder.buckets = stopping_buckets
        step(models)
        push(sync, result, "bucket")
        result["bucket"]["detect_s"] = result["bucket"]["end"] - stopped[1]
        sync.transport.resharder.buckets = buckets
        result["bucket"]["served"] = probe(client, 0)
        os.kill(launchers[1].procs[0].pid, signal.SIGCONT)
        step(models)
        push(sync, result, "bucket_back")
        asyncio.run(client.probe_down())
        result["bucket_back"]["served"] = [probe(client, i) for i in range(2)]
        result["bucket_back"]["healthy"] = [s.healthy for s in client.servers]
        sync.close()
    finally:
        for i in stopped:
            os.kill(launchers[i].procs[0].pid, signal.SIGCONT)
        pool.shutdown(wait=True)
        for launcher in launchers:
            launcher.stop()
        result["lines"] = [(round(at - stopped.get(0, at), 3), msg) for at, msg in lines.lines]
        with open(args.out, "w") as f:
            json.dump(result, f)
        destroy_parallel_state()


if __name__ == "__main__":
    main()
