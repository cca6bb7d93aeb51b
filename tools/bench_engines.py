"""The real SGLang CPU engine against the embedded server, same card, same workload, one run (ratios).

For each engine in turn (one server at a time, started by the project's launcher, float32, one thread,
`--enable-return-routed-experts`):
  generation   `--requests` requests of `--new-tokens` tokens (EOS ignored, temperature 1), all sent at once through
               the real client: output tokens per second (the median of `--rounds` rounds)
  agreement    greedy sequences with their logprobs and routed experts, against transformers' forward of the card in
               float32 (the trainer's reference numbers): mean and max |logprob difference|, and the fraction of
               (token, layer) routes whose expert set equals transformers' router top-k
  weight sync  `--pushes` pushes of the distributed sync (one Megatron rank, gloo, SGLang's weight-update sessions)
               with the default abort pause, each with its parts: pause, buckets (gather, broadcast, server), commit
               and continue, as distributed_sync reports them and the pause bracket's events; with the server
               idle, then with 8 requests decoding throughout (what a run's sync meets), then the same without
               aborting ahead of the pause (`busy_pause_only`, the bracket before it did: the baseline of
               `SGLangClient.abort_in_flight`, which spares real SGLang's pause its 1 s poll)
Writes JSON (`--out`) and prints a table. The real engine needs `$SGLANG_CPU_VENV` (tools/install_sglang_cpu.sh).

    python tools/bench_engines.py --out benchmarks/engines_cpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CARD = ROOT / "models" / "tiny-qwen3-moe"


class Timeline:
    """The sync's events (EventLog's interface, kept in memory): pause and continue times per push."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, dict]] = []

    def emit(self, kind: str, **fields) -> None:
        self.events.append((time.perf_counter(), kind, fields))

    def span(self, *a, **k):
        import contextlib

        return contextlib.nullcontext()

    def phase_s(self, phase: str) -> list[float]:
        starts = [t for t, k, f in self.events if k == "sync_start" and f.get("phase") == phase]
        ends = [t for t, k, f in self.events if k == "sync_end" and f.get("phase") == phase]
        return [e - s for s, e in zip(starts, ends)]


def generation(client, requests: int, new_tokens: int, rounds: int) -> dict:
    from mega_async.api.types import ModelRequest

    reqs = [ModelRequest(input_ids=[1 + (7 * i + j) % 900 for j in range(16)], max_new_tokens=new_tokens,
                         temperature=1.0, ignore_eos=True) for i in range(requests)]

    async def once() -> float:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(client.agenerate(r) for r in reqs))
        return sum(len(o.output_tokens) for o in outs) / (time.perf_counter() - t0)

    asyncio.run(once())  # warm-up
    runs = [asyncio.run(once()) for _ in range(rounds)]
    return {"tok_s": statistics.median(runs), "runs": runs}


def agreement(client, hf, prompts: int, new_tokens: int) -> dict:
    cfg = hf.config
    diffs, same, total = [], 0, 0
    for i in range(prompts):
        prompt = [1 + (11 * i + 3 * j) % 900 for j in range(12)]
        out = asyncio.run(client.generate_on(0, {
            "input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}))
        ids = prompt + out["output_ids"]
        with torch.no_grad():
            res = hf(torch.tensor([ids]), output_router_logits=True)
        ref = torch.log_softmax(res.logits[0].double(), -1)[len(prompt) - 1:-1]
        ref = ref.gather(1, torch.tensor(out["output_ids"])[:, None]).squeeze(1)
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
        diffs.append((got - ref).abs())
        routes = torch.frombuffer(bytearray(base64.b64decode(out["meta_info"]["routed_experts"])), dtype=torch.int32)
        routes = routes.view(len(ids) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok).sort(-1).values
        for layer, lg in enumerate(res.router_logits):
            want = lg.view(len(ids), -1)[:-1].topk(cfg.num_experts_per_tok, -1).indices.sort(-1).values
            same += int((routes[:, layer] == want.to(torch.int32)).all(-1).sum())
            total += len(ids) - 1
    d = torch.cat(diffs)
    return {"logprob_abs_mean": float(d.mean()), "logprob_abs_max": float(d.max()), "route_set_agreement": same / total,
            "tokens": int(d.numel())}


def weight_sync(addresses, pushes: int) -> dict:
    """`pushes` pushes with the server idle, then `pushes` with 8 requests decoding throughout (the abort pause answers
    them with their partial output; the client resubmits them after the sync): the median of each part."""
    import threading

    from mega_async.inference.client import SGLangClient
    from mega_async.trainer.model import build_model
    from mega_async.trainer.sync import distributed_sync, RolloutSide
    from mega_async.api.types import ModelRequest, WeightVersion

    models = build_model(str(CARD), "megatron:d1", load_weights=True)
    version = WeightVersion()
    client = SGLangClient(addresses, version=version, request_timeout=600)
    out: dict = {}
    for case in ("idle", "busy", "busy_pause_only"):
        if case == "busy_pause_only":  # the pause alone aborts what is in flight, as the bracket once did
            async def pause_only(timeout: float) -> int:
                return client._in_flight

            client.abort_in_flight = pause_only
        events = Timeline()
        sync = distributed_sync(models, version, RolloutSide(client), addresses, timeout=120, events=events)
        stop = threading.Event()

        async def decode() -> None:
            async def one(i: int) -> None:
                while not stop.is_set():
                    await client.agenerate(ModelRequest(input_ids=[5 + i, 6, 7], max_new_tokens=256, ignore_eos=True))

            await asyncio.gather(*(one(i) for i in range(8)))

        load = threading.Thread(target=lambda: asyncio.run(decode())) if case != "idle" else None
        rows = []
        try:
            if load is not None:
                load.start()
                time.sleep(3.0)  # decoding
            for _ in range(pushes):
                with torch.no_grad():
                    for p in models[0].parameters():
                        p.add_(1e-3 * torch.randn_like(p))
                rows.append(sync.push())
                time.sleep(0.5)
        finally:
            stop.set()
            if load is not None:
                load.join(600)
            sync.close()
        keys = ["sync/push_s", "sync/total_s", "sync/gather_s", "sync/broadcast_s", "sync/server_s", "sync/bucket_s"]
        res = {k.split("/")[1]: statistics.median(r[k] for r in rows) for k in keys if all(k in r for r in rows)}
        res["pause_s"] = statistics.median(events.phase_s("pause"))
        res["continue_s"] = statistics.median(events.phase_s("continue"))
        res["buckets"] = rows[-1].get("sync/buckets")
        out[case] = res
    return out


def bench(engine: str, args, hf) -> dict:
    from mega_async.inference.client import SGLangClient
    from mega_async.inference.servers import ServerLauncher, ServerSpec
    from mega_async.trainer.parallel import destroy_parallel_state

    kw = {"device": "cpu"} if engine == "sglang" else {}
    spec = ServerSpec(engine, str(CARD), dtype="float32", num_threads=args.threads,
                      extra_args=["--enable-return-routed-experts"], **kw)
    t0 = time.perf_counter()
    with ServerLauncher(spec, log_dir=f"{args.logs}/{engine}", startup_timeout=600) as launcher:
        ready = time.perf_counter() - t0
        client = SGLangClient(launcher.addresses, request_timeout=600)
        res = {"ready_s": ready, "generation": generation(client, args.requests, args.new_tokens, args.rounds),
               "agreement": agreement(client, hf, args.prompts, args.new_tokens // 2),
               "sync": weight_sync(launcher.addresses, args.pushes)}
        destroy_parallel_state()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engines", default="embedded,sglang")
    ap.add_argument("--logs", default="/tmp/bench_engines_logs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from mega_async.bridge.model_cards import ensure_weights

    ensure_weights(CARD)
    hf = AutoModelForCausalLM.from_pretrained(CARD, dtype=torch.float32).eval()
    results = {e: bench(e, args, hf) for e in args.engines.split(",")}
    for e, r in results.items():  # the same run's baseline: the bracket without aborting ahead of the pause
        r["sync"]["pause_only_over_abort_ahead"] = {k: r["sync"]["busy_pause_only"][k] / r["sync"]["busy"][k]
                                                    for k in ("push_s", "pause_s")}
    if {"embedded", "sglang"} <= set(results):
        e, s = results["embedded"], results["sglang"]
        results["ratios"] = {"tok_s_sglang_over_embedded": s["generation"]["tok_s"] / e["generation"]["tok_s"],
                             **{f"push_s_{c}_sglang_over_embedded": s["sync"][c]["push_s"] / e["sync"][c]["push_s"]
                                for c in ("idle", "busy")}}
    results["workload"] = vars(args)
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
