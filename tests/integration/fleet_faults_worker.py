"""One trainer rank over 64 simulated fleet servers with the real client, executor, ledger and
distributed_sync(data_plane="none"): a run of training steps while 10% of the servers crash at random
moments and come back as new processes at their launch weights. Writes what the test checks as JSON."""
import argparse
import json
import random
import threading
import time
from pathlib import Path

import torch

from mega_async.inference.client import SGLangClient
from mega_async.inference.sim.fleet import Fleet, FleetConfig
from mega_async.inference.sim.fleet.schedule import parse_fractions, random_schedule
from mega_async.rollout.dataloader import Sample
from mega_async.rollout.executor import WorkflowExecutor
from mega_async.rollout.ledger import Ledger
from mega_async.rollout.workflow import RLVRWorkflow
from mega_async.trainer.model import build_model
from mega_async.trainer.parallel import destroy_parallel_state
from mega_async.trainer.sync import distributed_sync, RolloutSide
from mega_async.api.types import WeightVersion

ETA, B = 2, 32


async def one_reward(prompt, completion, **item):
    return 1.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--servers", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--failures", default="", help="kind=fraction,... (crash, hang, slow, error): the fleet's own "
                                                     "random schedule over the first 6 s instead of 10%% crashes")
    a = ap.parse_args()
    models = build_model(a.model, "megatron:d1", load_weights=True)
    cfg = FleetConfig(length_median=40, length_sigma=0.8, token_latency_s=0.004, batch_latency_s=1e-4, ttft_s=0.005,
                      load_s=0.0)
    rng = random.Random(a.seed)
    schedule = random_schedule(a.servers, a.seed, (0.2, 6.0), parse_fractions(a.failures), (0.5, 3.0)) \
        if a.failures else []
    killed = [e.server for e in schedule if e.kind == "crash"] if a.failures else \
        rng.sample(range(a.servers), max(1, a.servers // 10))
    result: dict = {"killed": killed, "schedule": [e.to_dict() for e in schedule]}
    out_dir = Path(a.out).parent
    try:
        with Fleet(a.servers, cfg, procs=2, schedule=schedule) as fleet:
            version = WeightVersion()
            client = SGLangClient(fleet.addresses, version=version, health_check_interval=0.2, retry_backoff=0.05,
                                  unhealthy_timeout=60)
            ledger = Ledger(out_dir / "rollouts.jsonl")
            ex = WorkflowExecutor(client, RLVRWorkflow(one_reward, max_new_tokens=160, stop_token_ids=[2]),
                                  consumer_batch_size=B, max_staleness=ETA, version=version, ledger=ledger)
            sync = distributed_sync(models, version, RolloutSide(client, ex), fleet.addresses,
                                         bucket_bytes=256 << 10, timeout=60, data_plane="none")
            items = (Sample(k, 0, {"input_ids": [k % 97 + 3, k % 89 + 5, 7, k % 1000]})
                     for k in range(100_000))
            kills = [] if a.failures else sorted((rng.uniform(0.2, 6.0), i) for i in killed)  # over the first steps

            def killer() -> None:
                t0 = time.monotonic()
                for at, i in kills:
                    time.sleep(max(0.0, t0 + at - time.monotonic()))
                    fleet.fail(i, "crash", duration=rng.uniform(0.5, 3.0))

            k = threading.Thread(target=killer, daemon=True)
            consumed, pushes = [], []
            with ex:
                k.start()
                for step in range(a.steps):
                    batch = ex.prepare_batch(items)
                    for t in batch:
                        m = t["loss_mask"][0].bool()
                        v, lp = t["versions"][0][m], t["logprobs"][0][m]
                        consumed.append({"head": version.value, "min": int(v.min()), "max": int(v.max()),
                                         "labels_ok": bool(torch.equal(torch.floor(-lp).long(), v))})
                    with torch.no_grad():
                        for p in models[0].parameters():
                            p.add_(1e-3)
                    pushes.append(sync.push())
                    if step == a.steps - 2:
                        k.join(30)
                        time.sleep(3.5)  # every crashed server is back before the last push
                stats = ex.stats
            ledger.close()
            sync.close()
            result.update(version=version.value, consumed=consumed, stats={k: v for k, v in stats.items()
                                                                          if isinstance(v, (int, float))},
                          states=fleet.state(), sessions_open=client.sessions_open,
                          behind=[s.address for s in client.servers if s.behind],
                          dropped=[s.address for s in client.servers if s.dropped], pushes=len(pushes),
                          addresses=fleet.addresses)
    finally:
        Path(a.out).write_text(json.dumps(result))
        destroy_parallel_state()


if __name__ == "__main__":
    main()
