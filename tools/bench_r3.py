"""Routing replay (R3) on the tiny MoE: a bfloat16 embedded server (routes on) generates rollouts, an fp32
single-rank Megatron trainer measures the train/rollout mismatch with replay off and on, and times
train_batch both ways (the ratio against replay off comes from the same run).

    python tools/bench_r3.py [--model DIR] [--n 16] [--max-new-tokens 32] [--reps 3] [--out r3.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

import torch

from mega_async.inference.client import SGLangClient
from mega_async.inference.servers import ServerLauncher, ServerSpec
from mega_async.bridge.model_cards import TINY_MOE, init_random_weights
from mega_async.rollout.workflow import trajectory_from_response
from mega_async.algo.batch import concat_padded
from mega_async.api.types import ModelRequest


async def rollouts(address: str, n: int, max_new: int, vocab: int, seed: int) -> list[dict]:
    client = SGLangClient([address])
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    try:
        resps = await asyncio.gather(*[client.agenerate(ModelRequest(p, max_new_tokens=max_new, temperature=1.0,
                                                                    return_routed_experts=True)) for p in prompts])
    finally:
        await client.aclose()
    return [trajectory_from_response(p, r, 0.0) for p, r in zip(prompts, resps)]


def mismatch(eng, batch: dict) -> dict[str, float]:
    """Routing agreement and |trainer - behaviour| logprob over the output tokens at the current weights."""
    out = eng.routing_mismatch(batch)
    lp = eng.compute_logprobs(batch)
    m = batch["loss_mask"].bool()
    gap = (lp - batch["logprobs"])[m].abs()
    out.update({"logprob_abs_mean": float(gap.mean()), "logprob_abs_max": float(gap.max())})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF MoE directory (default: the tiny MoE, random init)")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoConfig

    from mega_async.trainer.engine import EngineConfig, MegatronTrainEngine
    from mega_async.trainer.parallel import destroy_parallel_state

    model = args.model or str(init_random_weights(TINY_MOE, tempfile.mkdtemp(prefix="r3_") + "/moe", seed=args.seed))
    spec = ServerSpec("embedded", model, dtype="bfloat16", seed=args.seed, extra_args=["--enable-return-routed-experts"])
    launcher = ServerLauncher(spec)
    try:
        address = launcher.start()[0]
        trajs = asyncio.run(rollouts(address, args.n, args.max_new_tokens, AutoConfig.from_pretrained(model).vocab_size,
                                     args.seed))
    finally:
        launcher.stop()
    batch = concat_padded(trajs)
    batch["advantages"] = torch.randn(batch["input_ids"].shape[0], generator=torch.Generator().manual_seed(1))
    eng = MegatronTrainEngine(model, "megatron:d1", EngineConfig.of(lr=1e-7, prox_logp="recompute"))
    res: dict = {"sequences": args.n, "output_tokens": int(batch["loss_mask"].sum())}
    for replay in (False, True):
        eng.cfg.algorithm.routing_replay = eng.routing.replay = replay
        res["replay_on" if replay else "replay_off"] = mismatch(eng, batch)
    times = {False: [], True: []}
    for _ in range(args.reps):  # interleaved, so load changes hit both alike
        for replay in (False, True):
            eng.cfg.algorithm.routing_replay = eng.routing.replay = replay
            t0 = time.perf_counter()
            eng.train_batch(batch)
            times[replay].append(time.perf_counter() - t0)
    off, on = min(times[False]), min(times[True])
    res["train_batch_s"] = {"replay_off": off, "replay_on": on, "ratio_on_vs_off": on / off}
    destroy_parallel_state()
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
