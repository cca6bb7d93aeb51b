"""How much a busy trainer core slows the inference server on the other core (one run, ratios).

Asynchronous RL overlaps generation with training; the overlap bound, (rollout + train) / max(rollout, train),
assumes the two run on resources that do not slow each other down. On one host with the cores split between
them (mega_async.launch.pinning), they still share caches, memory bandwidth and, on a virtual machine, perhaps a
physical core. This measures what that costs the server: one embedded server pinned to the first half of the
CPUs generates `--requests` requests of `--new-tokens` tokens (temperature 1, EOS ignored, all sent at once),
in rounds that alternate between the other half idle and the other half running a training step loop of the
same card (forward, backward and an Adam step on packed random tokens, in one process per CPU of that half,
one torch thread each). Reports output tokens per second in each state (median of the rounds) and the ratio.

    python tools/bench_contention.py --out benchmarks/contention_cpu.json
    python tools/bench_contention.py --model runs/countdown_sft/run0/final_hf --rounds 5
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRAIN_LOOP = r"""
import sys, time, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
opt = torch.optim.Adam(model.parameters(), lr=1e-5)
tokens = int(sys.argv[2])
ids = torch.randint(1, model.config.vocab_size, (1, tokens))
print("ready", flush=True)
while True:
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def generation(client, requests: int, new_tokens: int) -> float:
    """Output tokens per second of one round of `requests` requests sent at once."""
    from mega_async.api.types import ModelRequest

    reqs = [ModelRequest(input_ids=[1 + (7 * i + j) % 900 for j in range(16)], max_new_tokens=new_tokens,
                         temperature=1.0, ignore_eos=True) for i in range(requests)]

    async def once() -> float:
        try:
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(client.agenerate(r) for r in reqs))
            return sum(len(o.output_tokens) for o in outs) / (time.perf_counter() - t0)
        finally:
            await client.aclose()

    return asyncio.run(once())


def start_trainers(model: str, cpus: list[int], tokens: int) -> list[subprocess.Popen]:
    """One training loop per CPU of the trainer's half, each pinned to its CPU; returns once each has started."""
    procs = []
    for cpu in cpus:
        p = subprocess.Popen([sys.executable, "-c", TRAIN_LOOP, model, str(tokens)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        os.sched_setaffinity(p.pid, {cpu})
        procs.append(p)
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            stop(procs)
            raise RuntimeError("the training loop did not start (see its stderr: run TRAIN_LOOP by hand)")
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="an HF directory (default: the countdown SFT model if trained, "
                                                  "else models/tiny-qwen3-moe)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--train-tokens", type=int, default=2048, help="tokens per training step of the busy loop")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per state (idle and busy alternate)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args(argv)
    from mega_async.inference.client import SGLangClient
    from mega_async.inference.servers import ServerLauncher, ServerSpec
    from mega_async.bridge.model_cards import ensure_weights
    from mega_async.launch.pinning import pin_threads, split_cpus

    model = a.model
    if model is None:
        sft = ROOT / "runs" / "countdown_sft" / "run0" / "final_hf"
        model = str(sft) if (sft / "config.json").exists() else str(ROOT / "models" / "tiny-qwen3-moe")
        if not (sft / "config.json").exists():
            ensure_weights(Path(model))
    if not (Path(model) / "config.json").exists():
        raise SystemExit(f"bench_contention: {model} has no config.json; pass an HF model directory with --model")
    server_cpus, trainer_cpus = split_cpus(sorted(os.sched_getaffinity(0)))
    spec = ServerSpec("embedded", model, num_threads=len(server_cpus))
    idle, busy = [], []
    with tempfile.TemporaryDirectory() as logs, ServerLauncher(spec, log_dir=logs, startup_timeout=300) as launcher:
        pin_threads(launcher.procs[0].pid, server_cpus)
        client = SGLangClient(launcher.addresses)
        generation(client, a.requests, a.new_tokens)  # warm-up
        for _ in range(a.rounds):
            pin_threads(launcher.procs[0].pid, server_cpus)  # threads it started since
            idle.append(generation(client, a.requests, a.new_tokens))
            procs = start_trainers(model, trainer_cpus, a.train_tokens)
            try:
                time.sleep(1.0)  # past its first steps
                busy.append(generation(client, a.requests, a.new_tokens))
            finally:
                stop(procs)
    res = {"model": model, "server_cpus": server_cpus, "trainer_cpus": trainer_cpus, "requests": a.requests,
           "new_tokens": a.new_tokens, "train_tokens": a.train_tokens, "idle_tok_s": idle, "busy_tok_s": busy,
           "idle_median": statistics.median(idle), "busy_median": statistics.median(busy),
           "busy_over_idle": statistics.median(busy) / statistics.median(idle), "load_after": os.getloadavg()}
    print(f"server on CPUs {server_cpus}, trainer loop on {trainer_cpus}: generation {res['idle_median']:.0f} tok/s "
          f"with the trainer's half idle, {res['busy_median']:.0f} tok/s with it training: "
          f"{res['busy_over_idle']:.2f}x")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
