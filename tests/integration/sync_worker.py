"""One trainer rank and two embedded servers: drive distributed_sync through one case, write JSON.

    inflight    long requests are in flight when the weights change: they are aborted, resumed, and
                finish with versions spanning the update. Server 0 mirrors SGLang 0.5.20 (no weight-update
                sessions), server 1 SGLang 0.5.23 (sessions required) and has a session left open by a trainer
                that died; afterwards no session is open. Then a trainer that opens no session (as before
                0.5.21) pushes one big bucket: server 1 refuses it at once and the sync fails without
                waiting for trainer.sync_timeout
    bad_server  server 1 runs a model without layer 3: it answers 400 in the middle of the buckets
    kill        server 1 is killed after the first bucket
After a failure both live servers must serve their old weights, continued, at version 0.
"""
import argparse
import asyncio
import concurrent.futures
import json
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


def probe(client: SGLangClient, i: int) -> dict:
    out = asyncio.run(client.generate_on(i, {"input_ids": PROBE, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}))
    info = asyncio.run(client._request("GET", client.servers[i], "/model_info"))[1]
    return {"tokens": out["output_ids"], "logprobs": [x[0] for x in out["meta_info"]["output_token_logprobs"]],
            "version": info["weight_version"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--second-model", required=True)
    ap.add_argument("--case", required=True, choices=["inflight", "bad_server", "kill"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--logs", required=True)
    ap.add_argument("--sglang-versions", default="0.5.23,0.5.23", help="the release each server mirrors")
    args = ap.parse_args()
    mirrors = args.sglang_versions.split(",")
    launchers = [ServerLauncher(ServerSpec("embedded", m, num_servers=1, num_threads=1,
                                           extra_args=["--weight-update-timeout", "20",
                                                       "--sglang-version", mirrors[i]]),
                                log_dir=f"{args.logs}/s{i}", startup_timeout=120)
                 for i, m in enumerate([args.model, args.second_model])]
    result: dict = {"case": args.case}
    pool = concurrent.futures.ThreadPoolExecutor(len(launchers))
    try:
        starting = [pool.submit(launcher.start) for launcher in launchers]  # both boot while the model is built
        models = build_model(args.model, "megatron:d1", load_weights=True)
        addresses = [a for f in starting for a in f.result()]
        version = WeightVersion()
        client = SGLangClient(addresses, version=version, health_check_interval=0.2)
        sync = distributed_sync(models, version, RolloutSide(client), addresses, bucket_bytes=64 << 10,
                                     timeout=20)
        result["before"] = [probe(client, i) for i in range(2)]
        with torch.no_grad():  # a "training step": the new version differs
            for p in models[0].parameters():
                p.add_(0.05 * torch.randn_like(p))
        if args.case == "kill":
            buckets = sync.transport.resharder.buckets

            def killing():
                for k, b in enumerate(buckets()):
                    if k == 1:
                        launchers[1].kill(0)
                    yield b

            sync.transport.resharder.buckets = killing
        responses: list = []
        if args.case == "inflight":  # a session left open on the 0.5.23 server by a trainer that died mid-sync
            result["stale_begin"] = asyncio.run(client._request("POST", client.servers[1], "/begin_weight_update",
                                                                {"selector": "all"}))[0]
            reqs = [ModelRequest(input_ids=PROBE[:3 + i % 3], max_new_tokens=300, ignore_eos=True) for i in range(8)]
            async def all_requests() -> list:
                return list(await asyncio.gather(*(client.agenerate(r) for r in reqs)))

            def generate() -> None:
                try:
                    responses.extend(asyncio.run(all_requests()))
                except BaseException as e:  # noqa: BLE001 - reported in the result
                    result["generate_error"] = repr(e)

            t = threading.Thread(target=generate)
            t.start()
            deadline = time.monotonic() + 60
            while sum(i["num_running_reqs"] for i in asyncio.run(_infos(client))) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)  # wait until the requests are decoding
        try:
            result["push"] = sync.push()
            result["error"] = None
        except SyncError as e:
            result["error"] = str(e)
        if args.case == "inflight":
            t.join(300)
            result["responses"] = [{"versions": r.output_versions, "stop": r.stop_reason,
                                    "interruptions": r.num_interruptions, "n": len(r.output_tokens)} for r in responses]
        live = [0] if args.case == "kill" else [0, 1]
        result["after"] = {i: probe(client, i) for i in live}
        result["version"] = version.value
        result["releases"] = [[r.version, r.sessions] for r in asyncio.run(client.learn_releases())]
        result["sessions_open"] = client.sessions_open
        # what each live server says of its session now: 400 "no weight-update session is open" (0.5.23), 404 (0.5.20)
        result["end_probe"] = {i: list(asyncio.run(client._request("POST", client.servers[i], "/end_weight_update",
                                                                    {}))) for i in live}
        if args.case == "inflight" and result["error"] is None:
            sync.transport.begin = lambda target: None  # a trainer written for SGLang < 0.5.21
            sync.transport.resharder.bucket_bytes = 1 << 30  # one bucket, larger than the sockets' buffers
            with torch.no_grad():
                for p in models[0].parameters():
                    p.add_(0.05 * torch.randn_like(p))
            t0 = time.monotonic()
            try:
                sync.push()
                result["refused_error"] = None
            except SyncError as e:
                result["refused_error"] = str(e)
            result["refused_s"] = time.monotonic() - t0
            result["refused_version"] = version.value
            try:  # the failed sync dropped the group: another push builds it again, fails again, claims nothing
                sync.push()
                result["after_refused"] = None
            except SyncError as e:
                result["after_refused"] = str(e)
            result["after_refused_version"] = version.value
        sync.close()
    finally:
        pool.shutdown(wait=True)  # a launcher still starting finishes (or fails) before it is stopped
        for launcher in launchers:
            launcher.stop()
        with open(args.out, "w") as f:
            json.dump(result, f)
        destroy_parallel_state()


async def _infos(client: SGLangClient) -> list:
    async def one(s):
        return (await client._request("GET", s, "/server_info"))[1]

    return list(await asyncio.gather(*(one(s) for s in client.servers)))


if __name__ == "__main__":
    main()
