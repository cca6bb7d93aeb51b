"""Radix (prefix) cache of the embedded server on a multi-turn workload, against --disable-radix-cache, one run.

`--episodes` agents run concurrently, `--turns` turns each: turn 1's prompt is `--system-len` tokens shared by
every agent plus `--user-len` of its own; each later prompt is the previous prompt + the model's reply
(`--reply-len` tokens) + `--user-len` new tokens, so each turn extends the last (as agents and multi-turn RL
episodes do). The same workload runs on one server with its radix cache and on one started with
--disable-radix-cache, alternately (`--repeats` each), every request over HTTP /generate with token ids.
Reported: the hit rate (cached_tokens / prompt tokens, from each answer's meta_info), prompt tokens actually
prefilled, wall time and generated tok/s (median of the runs); whether the outputs (temperature 0) agree.

    python tools/bench_prefix_cache.py --episodes 8 --turns 6
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

from mega_async.inference.servers import ServerLauncher, ServerSpec
from mega_async.bridge.model_cards import TINY_MOE, init_random_weights


async def episode(session: aiohttp.ClientSession, url: str, first: list[int], users: list[list[int]],
                  reply_len: int) -> list[dict]:
    """One agent: each turn sends the whole conversation so far and appends the reply and the next user turn."""
    prompt, turns = list(first), []
    for t in range(len(users) + 1):
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": reply_len, "temperature": 0,
                                                         "ignore_eos": True}}
        async with session.post(f"{url}/generate", json=body) as r:
            out = await r.json()
            assert r.status == 200, out
        turns.append({"prompt": len(prompt), "cached": out["meta_info"]["cached_tokens"], "output": out["output_ids"]})
        if t < len(users):
            prompt = prompt + out["output_ids"] + users[t]
    return turns


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[list[list[int]]]]:
    g = torch.Generator().manual_seed(0)
    rnd = lambda n: torch.randint(1, 1000, (n,), generator=g).tolist()  # noqa: E731
    system = rnd(args.system_len)
    firsts = [system + rnd(args.user_len) for _ in range(args.episodes)]
    users = [[rnd(args.user_len) for _ in range(args.turns - 1)] for _ in range(args.episodes)]
    return firsts, users


def run_server(model_dir: Path, args: argparse.Namespace, extra: tuple[str, ...]) -> dict:
    firsts, users = workload(args)
    spec = ServerSpec("embedded", str(model_dir), num_servers=1, num_threads=args.num_threads,
                      extra_args=["--max-running-requests", str(args.episodes), *extra])
    with ServerLauncher(spec, startup_timeout=120) as launcher:
        url = f"http://{launcher.addresses[0]}"

        async def go() -> tuple[float, list[list[dict]]]:
            timeout = aiohttp.ClientTimeout(total=3600)
            async with aiohttp.ClientSession(timeout=timeout) as s:
                await episode(s, url, [7, 8, 9], [], 4)  # warm-up (a prompt no episode shares)
                t0 = time.perf_counter()
                eps = await asyncio.gather(*(episode(s, url, f, u, args.reply_len) for f, u in zip(firsts, users)))
                return time.perf_counter() - t0, eps

        dt, eps = asyncio.run(go())
    turns = [t for ep in eps for t in ep]
    prompt, cached = sum(t["prompt"] for t in turns), sum(t["cached"] for t in turns)
    generated = sum(len(t["output"]) for t in turns)
    return {"wall_s": dt, "gen_tok_per_s": generated / dt, "hit_rate": cached / prompt,
            "prompt_tokens": prompt, "prefilled_tokens": prompt - cached,
            "outputs": [[t["output"] for t in ep] for ep in eps]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=8, help="concurrent multi-turn agents")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=256, help="prompt tokens shared by every episode")
    ap.add_argument("--user-len", type=int, default=64, help="new user tokens per turn")
    ap.add_argument("--reply-len", type=int, default=32, help="generated tokens per turn")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each server, alternating (medians reported)")
    ap.add_argument("--num-threads", type=int, default=None, help="server CPU threads (default: all cores)")
    ap.add_argument("--model", default=None, help="HF model dir (default: tiny-qwen3-moe, random init)")
    args = ap.parse_args()
    model_dir = Path(args.model) if args.model else init_random_weights(TINY_MOE, Path(tempfile.mkdtemp()) / "m", seed=0)
    runs: dict[str, list[dict]] = {"radix": [], "disabled": []}
    for _ in range(args.repeats):
        runs["disabled"].append(run_server(model_dir, args, ("--disable-radix-cache",)))
        runs["radix"].append(run_server(model_dir, args, ()))
    same = all(r["outputs"] == runs["disabled"][0]["outputs"] for v in runs.values() for r in v)
    summary = {k: {"gen_tok_per_s": round(statistics.median(r["gen_tok_per_s"] for r in v), 1),
                   "runs_tok_per_s": [round(r["gen_tok_per_s"], 1) for r in v],
                   "wall_s": [round(r["wall_s"], 2) for r in v], "hit_rate": round(v[0]["hit_rate"], 3),
                   "prompt_tokens": v[0]["prompt_tokens"], "prefilled_tokens": v[0]["prefilled_tokens"]}
               for k, v in runs.items()}
    res = {"episodes": args.episodes, "turns": args.turns, "system_len": args.system_len, "user_len": args.user_len,
           "reply_len": args.reply_len, **summary, "outputs_identical": same,
           "speedup": round(summary["radix"]["gen_tok_per_s"] / summary["disabled"]["gen_tok_per_s"], 2)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
