"""Embedded server generation throughput vs plain `transformers` generate(), same tiny model, one run.

Scenario "fixed": both generate `--batch` sequences of exactly `--new-tokens` tokens (EOS ignored)
with sampling at temperature 1.0 from the same prompts: static batching's best case.
Scenario "varied": RL-like long-tailed output lengths (lognormal, mean about `--new-tokens`,
capped at 4x): generate() must run each batch until its longest sequence ends, the server
retires finished rows and admits waiting requests in their place (`--batch` running at a time,
`--requests` in all). Throughput counts useful tokens only.
The server is started by the launcher and driven over HTTP by the real client (all requests
concurrent), so its figures include HTTP and batching overheads.

    python tools/bench_generation.py --batch 32 --new-tokens 128
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
from mega_async.inference.launch import ServerLauncher, ServerSpec
from mega_async.model_cards import TINY_MOE, init_random_weights
from mega_async.types import ModelRequest


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


def bench_server(model_dir: Path, prompts: list[list[int]], lengths: list[int], batch: int) -> float:
    spec = ServerSpec("embedded", str(model_dir), num_servers=1, extra_args=["--max-running-requests", str(batch)])
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=128, help="requests in the varied scenario")
    ap.add_argument("--model", default=None, help="HF model dir (default: tiny-qwen3-moe, random init)")
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
    for name, ps, ks in (("fixed", prompts[:args.batch], fixed), ("varied", prompts, varied)):
        server = bench_server(model_dir, ps, ks, args.batch)
        hf = bench_hf(model_dir, ps, ks, args.batch)
        res[name] = {"embedded_server_tok_per_s": round(server), "transformers_generate_tok_per_s": round(hf),
                     "ratio": round(server / hf, 2)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
