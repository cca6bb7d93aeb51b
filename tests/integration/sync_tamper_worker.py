"""One trainer rank, one or two embedded servers, each behind a TamperProxy; the last server's proxy tampers with
one sync per case. Writes JSON: per case the sync's error (or None), how long the push took, the warnings logged
during it, what the proxy did, and then whether the next (clean) sync brought every server back to the current
version. Run by tests/integration/test_sync_tamper.py.

    python sync_tamper_worker.py --model DIR --root DIR --servers 2 --sync distributed --method checksum \
        --cases ack,drop_expert --port 0 --out result.json --logs DIR
"""
import argparse
import asyncio
import concurrent.futures
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tamper_proxy import TamperProxy  # noqa: E402

from mega_async.inference.client import SGLangClient  # noqa: E402
from mega_async.inference.servers import ServerLauncher, ServerSpec  # noqa: E402
from mega_async.trainer.engine import EngineConfig, MegatronTrainEngine  # noqa: E402
from mega_async.trainer.parallel import destroy_parallel_state  # noqa: E402
from mega_async.trainer.sync import disk_sync, distributed_sync, RolloutSide, SyncError  # noqa: E402
from mega_async.api.types import WeightVersion  # noqa: E402
from tests.dist.engine_worker import synthetic_batch  # noqa: E402

TIMEOUT = 60.0  # trainer.sync_timeout: every fault must be found long before it


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def step(eng, seed: int, zero: bool = False, shake: bool = False) -> None:
    """One real training step as a run takes it: the engine's PPO update (Adam at the default trainer.lr,
    1e-5) on a synthetic batch; `zero`: every advantage 0, so the step leaves the weights as they were (as a step of
    groups with equal rewards does). `shake` (the probe's layouts): every weight moved by 0.02 x randn instead, a
    change the probe's logprob tolerance can see (it cannot see a real step's: test_sync_tamper.py)."""
    if shake and not zero:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in eng.models[0].parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=g).to(p.dtype))
        return
    b = synthetic_batch(seed=seed)
    if zero:
        b["advantages"].zero_()
    eng.train_batch(b)


def push(sync) -> dict:
    t0 = time.monotonic()
    try:
        sync.push()
        error = None
    except SyncError as e:
        error = str(e)
    return {"error": error, "s": round(time.monotonic() - t0, 3), "version": sync.version.value}


def served(client: SGLangClient) -> list:
    async def one(s):
        try:
            return (await client._request("GET", s, "/model_info", timeout=10))[1].get("weight_version")
        except Exception as e:  # noqa: BLE001
            return repr(e)

    async def every():
        return [await one(s) for s in client.servers]
    return asyncio.run(every())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--root", required=True, help="the servers' weights_root (disk: the sync writes under it)")
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--sync", choices=["distributed", "disk"], required=True)
    ap.add_argument("--method", choices=["probe", "checksum"], required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--port", type=int, default=0, help="the first proxy's port (the next ones follow); 0: free ports")
    ap.add_argument("--fp8", action="store_true", help="trainer.sync_weight_format=fp8_block (an FP8 card)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--logs", required=True)
    args = ap.parse_args()
    lines = Lines()
    logging.getLogger("mega_async").addHandler(lines)
    launchers = [ServerLauncher(ServerSpec("embedded", args.model, num_servers=1, num_threads=1,
                                           weights_root=args.root, extra_args=["--weight-update-timeout", "60"]),
                                log_dir=f"{args.logs}/s{i}", startup_timeout=120) for i in range(args.servers)]
    proxies: list[TamperProxy] = []
    result: dict = {"cases": {}}
    pool = concurrent.futures.ThreadPoolExecutor(len(launchers))
    sync = None
    try:
        starting = [pool.submit(launcher.start) for launcher in launchers]
        version = WeightVersion()
        eng = MegatronTrainEngine(args.model, "megatron:d1", EngineConfig.of(), version=version)
        servers = [a for f in starting for a in f.result()]
        proxies = [TamperProxy(a, args.port + i if args.port else 0).start() for i, a in enumerate(servers)]
        client = SGLangClient([p.address for p in proxies], version=version, health_check_interval=0.2,
                              request_timeout=120)
        result["addresses"] = client.addresses
        kw = dict(timeout=TIMEOUT, verify=eng.compute_logprobs, verify_method=args.method,
                  weight_format="fp8_block" if args.fp8 else "model_dtype")
        if args.sync == "disk":
            sync = disk_sync(eng.models, version, RolloutSide(client), Path(args.root) / "weights",
                                  src_dir=args.model, keep=3, **kw)
        else:
            sync = distributed_sync(eng.models, version, RolloutSide(client), client.addresses,
                                         bucket_bytes=64 << 10, **kw)
        shake = args.method == "probe"
        step(eng, 0, shake=shake)
        result["first"] = push(sync)
        tamper = proxies[-1]
        for n, case in enumerate(args.cases.split(",")):
            if not case.endswith("_unchanged"):  # else the spoiled sync sends the weights of the last one (as a
                step(eng, n + 1, shake=shake)  # step does that changes nothing: zero advantages and no momentum yet)
            old = str(sync.transport.path(version.value)) if args.sync == "disk" else None
            tamper.set(case.removesuffix("_unchanged"), bucket=2, old_dir=old)
            tamper.log.clear()
            del lines.lines[:]
            out = push(sync)
            out["proxy"] = list(tamper.log)
            out["warnings"] = list(lines.lines)
            tamper.set(None)
            # the fault-tolerance rules: a server taken out answers again, is re-admitted behind, and the next sync
            # brings it to the current version
            asyncio.run(client.probe_down())
            step(eng, 100 + n, zero=True)  # the next sync holds unchanged weights: judged by the digest, not blamed
            out["next"] = push(sync)
            out["next"]["stats"] = {k: v for k, v in sync.last.items() if k.startswith("sync/verify")}
            asyncio.run(client.probe_down())
            out["next"]["served"] = served(client)
            out["next"]["healthy"] = [s.healthy for s in client.servers]
            result["cases"][case] = out
    finally:
        if sync is not None:
            sync.close()
        for p in proxies:
            p.stop()
        pool.shutdown(wait=True)
        for launcher in launchers:
            launcher.stop()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        destroy_parallel_state()


if __name__ == "__main__":
    main()
