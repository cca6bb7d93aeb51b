"""Embedded server generation throughput vs plain `transformers` generate(), same tiny model, one run.

Scenario "fixed": both generate `--batch` sequences of exactly `--new-tokens` tokens (EOS ignored)
with sampling at temperature 1.0 from the same prompts: static batching's best case.
Scenario "varied": RL-like long-tailed output lengths (lognormal, mean about `--new-tokens`,
capped at 4x): generate() must run each batch until its longest sequence ends, the server
retires finished rows and admits waiting requests in their place (`--batch` running at a time,
`--requests` in all). Throughput counts useful tokens only.
Scenario "group": GRPO groups, `--group-size` samples of each of `--groups` long prompts
(`--group-prompt-len` tokens), all sent at once: the server with its prefix cache (one prefill per
group, the other samples join from the cached KV) against the same server with --disable-radix-cache,
started one after the other in the same run (alternating, twice each).
The server is started by the launcher and driven over HTTP by the real client (all requests
concurrent), so its figures include HTTP and batching overheads.

    python tools/bench_generation.py --batch 32 --new-tokens 128
    python tools/bench_generation.py --scenario group --group-size 8
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from mega_async.inference.client import SGLangClient
from mega_async.inference.servers import ServerLauncher, ServerSpec
from mega_async.bridge.model_cards import TINY_MOE, init_random_weights
from mega_async.api.types import ModelRequest


def bench_hf(model_dir: Path, prompts: list[list[int]], lengths: list[int], batch: int) -> float:
    """transformers generate() in static batches of `batch`; each batch runs to its longest length."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    with torch.no_grad():
        model.generate(torch.tensor(prompts[:2]), max_new_tokens=8, min_new_tokens=8, **kw)  # warm-up
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            n = max(lengths[i:i + batch])
            out = model.generate(torch.tensor(prompts[i:i + batch]), max_new_tokens=n, min_new_tokens=n, **kw)
            assert out.shape[1] - len(prompts[i]) == n
        dt = time.perf_counter() - t0
    return sum(lengths) / dt


def bench_server(model_dir: Path, prompts: list[list[int]], lengths: list[int], batch: int,
                 extra: tuple[str, ...] = ()) -> float:
    spec = ServerSpec("embedded", str(model_dir), num_servers=1,
                      extra_args=["--max-running-requests", str(batch), *extra])
    with ServerLauncher(spec, startup_timeout=120) as launcher:
        client = SGLangClient(launcher.addresses)

        async def run(ps: list[list[int]], ks: list[int]) -> float:
            reqs = [ModelRequest(input_ids=p, max_new_tokens=k, temperature=1.0, ignore_eos=True) for p, k in zip(ps, ks)]
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(client.agenerate(r) for r in reqs))
            dt = time.perf_counter() - t0
            assert [len(o.output_tokens) for o in outs] == ks
            return sum(ks) / dt

        asyncio.run(run(prompts[:2], [8, 8]))  # warm-up
        return asyncio.run(run(prompts, lengths))


def bench_groups(model_dir: Path, args: argparse.Namespace) -> dict:
    """Generation tok/s for GRPO groups with the prefix cache against no sharing, same prompts, same run."""
    g = torch.Generator().manual_seed(1)
    base = torch.randint(1, 1000, (args.groups, args.group_prompt_len), generator=g).tolist()
    prompts = [p for p in base for _ in range(args.group_size)]
    lengths = [args.group_new_tokens] * len(prompts)
    batch = len(prompts)
    runs: dict[str, list[float]] = {"shared": [], "no_sharing": []}
    for _ in range(2):
        runs["no_sharing"].append(bench_server(model_dir, prompts, lengths, batch, ("--disable-radix-cache",)))
        runs["shared"].append(bench_server(model_dir, prompts, lengths, batch))
    shared, plain = sum(runs["shared"]) / 2, sum(runs["no_sharing"]) / 2
    return {"groups": args.groups, "group_size": args.group_size, "prompt_len": args.group_prompt_len,
            "new_tokens": args.group_new_tokens, "prefix_cache_tok_per_s": round(shared),
            "no_sharing_tok_per_s": round(plain), "ratio": round(shared / plain, 2),
            "runs": {k: [round(x) for x in v] for k, v in runs.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=128, help="requests in the varied scenario")
    ap.add_argument("--model", default=None, help="HF model dir (default: tiny-qwen3-moe, random init)")
    ap.add_argument("--scenario", choices=("batching", "group", "all"), default="all")
    ap.add_argument("--groups", type=int, default=8, help="distinct prompts in the group scenario")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt in the group scenario")
    ap.add_argument("--group-prompt-len", type=int, default=1024)
    ap.add_argument("--group-new-tokens", type=int, default=32)
    args = ap.parse_args()
    model_dir = Path(args.model) if args.model else init_random_weights(TINY_MOE, Path(tempfile.mkdtemp()) / "m", seed=0)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 1000, (args.requests, args.prompt_len), generator=g).tolist()
    sigma = 0.8  # lognormal with mean new_tokens
    varied = torch.distributions.LogNormal(math.log(args.new_tokens) - sigma**2 / 2, sigma).sample((args.requests,))
    varied = varied.clamp(4, 4 * args.new_tokens).round().long().tolist()
    fixed = [args.new_tokens] * args.batch
    res: dict = {"batch": args.batch, "new_tokens": args.new_tokens, "requests_varied": args.requests}
    if args.scenario in ("group", "all"):
        res["group"] = bench_groups(model_dir, args)
    scenarios = (("fixed", prompts[:args.batch], fixed), ("varied", prompts, varied))
    for name, ps, ks in scenarios if args.scenario != "group" else ():
        server = bench_server(model_dir, ps, ks, args.batch)
        hf = bench_hf(model_dir, ps, ks, args.batch)
        res[name] = {"embedded_server_tok_per_s": round(server), "transformers_generate_tok_per_s": round(hf),
                     "ratio": round(server / hf, 2)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
