"""One trainer rank, one server (embedded or real SGLang on CPU), the distributed sync: kill -9 of the server
after a push, started again at its address (as the run's supervisor does), and the trainer waiting for a batch
that only this server can generate. The restarted server is behind (its launch weights, version 0): the client's
recover hook asks the sync to catch it up, rank 0's wait is interrupted, every rank broadcasts the current
version into it (`run.head.await_groups`), the client re-admits it, and the batch is generated at the current
version. Then one more push (the group is built again). Writes JSON.
"""
import argparse
import asyncio
import json
import time

import torch

from mega_async.inference.client import SGLangClient
from mega_async.inference.servers import ServerLauncher, ServerSpec
from mega_async.bridge.model_cards import ensure_weights
from mega_async.rollout.executor import WaitInterrupted, WorkflowExecutor
from mega_async.rollout.ledger import Ledger
from mega_async.rollout.workflow import GroupWorkflow, RLVRWorkflow
from mega_async.run.head import await_groups
from mega_async.trainer.model import build_model
from mega_async.trainer.parallel import destroy_parallel_state
from mega_async.trainer.sync import distributed_sync, RolloutSide
from mega_async.api.types import WeightVersion

PROBE = [3, 14, 15, 92, 65, 35]
ITEMS = [{"input_ids": [1 + i % 50, 2, 3], "answer": i} for i in range(64)]


def probe(client: SGLangClient) -> dict:
    out = asyncio.run(client.generate_on(0, {"input_ids": PROBE, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}))
    info = asyncio.run(client._request("GET", client.servers[0], "/model_info"))[1]
    return {"tokens": out["output_ids"], "logprobs": [x[0] for x in out["meta_info"]["output_token_logprobs"]],
            "version": info["weight_version"]}


class Head:
    """The part of the run's RolloutHead that await_groups uses: the step's groups from the executor."""

    def __init__(self, ex: WorkflowExecutor):
        self.ex, self.interrupted = ex, 0

    def groups(self, interrupt=None):
        try:
            return self.ex.prepare_batch(ITEMS, interrupt=interrupt)
        except WaitInterrupted:
            self.interrupted += 1
            return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--engine", choices=["embedded", "sglang"], default="embedded")
    ap.add_argument("--out", required=True)
    ap.add_argument("--logs", required=True)
    args = ap.parse_args()
    ensure_weights(args.model)
    spec = ServerSpec(args.engine, args.model, num_servers=1, num_threads=1,
                      **({"device": "cpu", "dtype": "float32"} if args.engine == "sglang" else {}))
    launcher = ServerLauncher(spec, log_dir=args.logs, startup_timeout=300)
    result: dict = {}
    try:
        addresses = launcher.start()
        models = build_model(args.model, "megatron:d1", load_weights=True)
        version = WeightVersion()
        # a behind server with no way back fails the wait after unhealthy_timeout (what happened before the fix)
        client = SGLangClient(addresses, version=version, health_check_interval=0.2, unhealthy_timeout=30)
        wf = GroupWorkflow(RLVRWorkflow(lambda p, c, **kw: 1.0, max_new_tokens=8), 2)
        ledger = Ledger(f"{args.logs}/rollouts.jsonl")
        with WorkflowExecutor(client, wf, consumer_batch_size=2, max_staleness=0, version=version.view(),
                              ledger=ledger) as ex:
            sync = distributed_sync(models, version, RolloutSide(client, ex), addresses, bucket_bytes=64 << 10,
                                         timeout=60)
            result["v0"] = probe(client)
            with torch.no_grad():  # a "training step": the new version differs
                for p in models[0].parameters():
                    p.add_(0.05 * torch.randn_like(p))
            sync.push()
            result["v1"] = probe(client)
            launcher.kill(0)  # kill -9; the run's supervisor starts it again at its address
            launcher.procs[0].wait(30)
            launcher.restart(0)
            client.expect_back(addresses[0], 300)
            caught = []
            catch_up = sync.catch_up
            sync.catch_up = lambda: (caught.append(time.monotonic()), catch_up())[1]
            head = Head(ex)
            t0 = time.monotonic()
            groups = await_groups(head, sync)
            result["waited_s"] = time.monotonic() - t0
            result["catch_ups"], result["interrupted"] = len(caught), head.interrupted
            result["batch_versions"] = sorted({int(v) for g in groups for v in g["versions"][g["loss_mask"].bool()]})
            result["after_catch_up"] = probe(client)
            with torch.no_grad():
                for p in models[0].parameters():
                    p.add_(0.05 * torch.randn_like(p))
            sync.push()
            result["v2"] = probe(client)
            result["stats"] = ex.stats
            sync.close()
        ledger.close()
    finally:
        launcher.stop()
        with open(args.out, "w") as f:
            json.dump(result, f)
        destroy_parallel_state()


if __name__ == "__main__":
    main()
