"""One trainer rank, distributed_sync(data_plane="none") and a fleet of simulated servers: the distributed
sync's whole control plane (release discovery, group, sessions, buckets, commit, end) with no tensor moved, while
requests are in flight; then the same seam refused against servers that have a data plane. Writes JSON."""
import argparse
import asyncio
import json
import threading
import time

import torch

from mega_async.inference.client import SGLangClient
from mega_async.inference.sim.fleet import Fleet, FleetConfig
from mega_async.trainer.model import build_model
from mega_async.trainer.parallel import destroy_parallel_state
from mega_async.trainer.sync import distributed_sync, RolloutSide, SyncError
from mega_async.api.types import ModelRequest, WeightVersion


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--servers", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    models = build_model(args.model, "megatron:d1", load_weights=True)
    result: dict = {}
    cfg = FleetConfig(length_median=400, length_sigma=0.0, token_latency_s=0.003, ttft_s=0.0)
    try:
        with Fleet(args.servers, cfg, in_thread=True) as fleet:
            version = WeightVersion()
            client = SGLangClient(fleet.addresses, version=version)
            t0 = time.perf_counter()
            sync = distributed_sync(models, version, RolloutSide(client), fleet.addresses, bucket_bytes=64 << 10,
                                         timeout=60, data_plane="none")
            result["init_s"] = time.perf_counter() - t0
            responses: list = []

            def generate() -> None:
                reqs = [ModelRequest(input_ids=[3, 1, 4, i], max_new_tokens=3000, ignore_eos=True) for i in range(32)]

                async def all_requests():
                    return await asyncio.gather(*(client.agenerate(r) for r in reqs))

                responses.extend(asyncio.run(all_requests()))

            t = threading.Thread(target=generate)
            t.start()
            time.sleep(0.3)
            pushes = []
            for _ in range(2):
                with torch.no_grad():
                    for p in models[0].parameters():
                        p.add_(0.01)
                pushes.append(sync.push())
            t.join(120)
            result.update(version=version.value, pushes=pushes, states=fleet.state(),
                          versions=[sorted(set(r.output_versions)) for r in responses],
                          stops=[r.stop_reason for r in responses], sessions_open=client.sessions_open)
            sync.close()
        with Fleet(1, cfg, in_thread=True) as fleet:  # a server without the fleet's marker: refused up front
            orig = SGLangClient.server_info

            async def real_server_info(self, timeout=None, addresses=None):
                return [{k: v for k, v in i.items() if k != "fleet"} for i in await orig(self, timeout, addresses)]

            SGLangClient.server_info = real_server_info  # what a real SGLang answers: no "fleet" section
            try:
                distributed_sync(models, WeightVersion(), RolloutSide(SGLangClient(fleet.addresses)),
                                      fleet.addresses, timeout=10, data_plane="none")
                result["refused"] = None
            except SyncError as e:
                result["refused"] = str(e)
            finally:
                SGLangClient.server_info = orig
    finally:
        with open(args.out, "w") as f:
            json.dump(result, f)
        destroy_parallel_state()


if __name__ == "__main__":
    main()
