"""GPU figures for tools/gpu_check.sh, each printed as one JSON line (`{"part": ..., ...}`):

  train-step  Megatron MoE train steps (the project's MegatronTrainEngine: decoupled PPO loss, DDP,
              distributed optimizer) on a ~1B-active Qwen3-MoE with random weights at bf16: tokens/s and
              MFU (6 x active params + attention flops per token, over the GPU's dense bf16 peak).
  server-gen  configs/bench/serve_gpu.yaml once: generation tokens/s of real SGLang started as the
              qwen3_30b_a3b recipe starts it (TP = EP over the GPUs) and of the embedded server on the same
              requests (the in-run baseline of the ratio); mega_async.bench.serving.

--cpu-dry-run runs both on the tiny model on CPU (fp32, gloo; server-gen on real SGLang's CPU engine, which
tools/install_sglang_cpu.sh builds): it checks this script's Python, not the figures. Without a GPU and without --cpu-dry-run a part prints {"skipped": reason}.

    python tools/bench_gpu.py train-step
    python tools/bench_gpu.py server-gen --cpu-dry-run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mega_async.bench.serving import MOE_1B  # noqa: E402 - the GPU scenarios' model size: ~1B active of ~2.7B

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, vocab_size=1024,
            max_position_embeddings=4096)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}


def active_params(c: dict[str, int]) -> tuple[int, int]:
    """(active, total) parameters of a Qwen3-MoE config (embeddings and output layer included)."""
    h, L, hd = c["hidden_size"], c["num_hidden_layers"], c["head_dim"]
    attn = h * hd * (c["num_attention_heads"] * 2 + c["num_key_value_heads"] * 2) + 2 * h + 2 * hd
    expert = 3 * h * c["moe_intermediate_size"]
    router = h * c["num_experts"]
    emb = 2 * c["vocab_size"] * h + h  # embedding, output layer, final norm
    active = L * (attn + router + c["num_experts_per_tok"] * expert) + emb
    total = L * (attn + router + c["num_experts"] * expert) + emb
    return active, total


def flops_per_token(c: dict[str, int], seq_len: int) -> float:
    """Training flops per token: 6 x active params plus attention scores/values (causal: half of 12 L s d)."""
    active, _ = active_params(c)
    attn = 12 * c["num_hidden_layers"] * c["num_attention_heads"] * c["head_dim"] * seq_len / 2
    return 6 * active + attn


def peak_tflops(name: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def _model_dir(c: dict[str, int]) -> Path:
    from transformers import Qwen3MoeConfig

    d = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    Qwen3MoeConfig(**c, rms_norm_eps=1e-6, tie_word_embeddings=False, norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[]).save_pretrained(d)
    return d


def _batch(n: int, L: int, vocab: int, prompt: int = 64) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    b = {"input_ids": torch.randint(1, vocab, (n, L), generator=g), "attention_mask": torch.ones(n, L, dtype=torch.long),
         "loss_mask": torch.zeros(n, L, dtype=torch.long), "logprobs": torch.zeros(n, L),
         "versions": torch.full((n, L), -1, dtype=torch.long), "advantages": torch.randn(n, generator=g)}
    b["loss_mask"][:, prompt:] = 1
    b["logprobs"][:, prompt:] = -torch.rand(n, L - prompt, generator=g) * 3 - 7
    b["versions"][:, prompt:] = 0
    return b


def train_step(dry: bool, steps: int, seqs: int, seq_len: int) -> dict[str, Any]:
    """Median step time of `steps` engine.train_batch calls after one warm-up step."""
    import torch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    import mega_async.trainer.model as model_mod
    from mega_async.trainer.engine import EngineConfig, MegatronTrainEngine

    c = TINY if dry else MOE_1B
    real_build = model_mod.build_model

    def random_weights(*a: Any, **kw: Any) -> Any:  # random init: no multi-GB safetensors to write first
        kw["load_weights"] = False
        return real_build(*a, **kw)

    model_mod.build_model = random_weights
    try:
        eng = MegatronTrainEngine(str(_model_dir(c)), "megatron:d1",
                                  EngineConfig.of(lr=1e-5, prox_logp="behavior", max_tokens_per_mb=min(16384, seqs * seq_len),
                                               total_steps=steps + 1),
                                  dtype=torch.float32 if dry else torch.bfloat16)
    finally:
        model_mod.build_model = real_build
    batch = _batch(seqs, seq_len, c["vocab_size"])
    times = []
    for i in range(steps + 1):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = eng.train_batch(batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    import torch.distributed as dist

    if dist.is_initialized():  # gloo's threads torn down here, not by the interpreter's exit (seen: SIGABRT, exit 134)
        dist.destroy_process_group()
    dt = statistics.median(times)
    tokens = seqs * seq_len
    tps = tokens / dt
    active, total = active_params(c)
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    peak = peak_tflops(dev)
    achieved = tps * flops_per_token(c, seq_len) / 1e12
    return {"part": "train-step", "device": dev, "active_params": active,
            "total_params": total, "tokens_per_step": tokens, "step_s": round(dt, 4),
            "tokens_per_s": round(tps, 1), "model_tflops": round(achieved, 2),
            "mfu": round(achieved / peak, 4) if peak and not dry else None, "loss": stats.get("loss"),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None}


def server_gen(dry: bool) -> dict[str, Any]:
    """configs/bench/serve_gpu.yaml's measurement once (mega_async.bench.serving): real SGLang as the recipe starts it
    and the embedded server, same requests; with --cpu-dry-run the tiny model on real SGLang's CPU engine."""
    import torch

    from mega_async.bench import serving
    from mega_async.bench.scenarios import load_scenario

    serve = load_scenario(ROOT / "configs" / "bench" / "serve_gpu.yaml").serve
    if dry:
        serve = serving.cpu_dry_run(serve)
    with tempfile.TemporaryDirectory(prefix="bench_gpu_srv_") as d:
        r = serving.serve_figures(serve, Path(d))
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"part": "server-gen", "device": dev, "gpus": torch.cuda.device_count(), "model": serve["model"],
            "batch": serve["batch"], "new_tokens": serve["new_tokens"],
            **{k: round(v, 3) if isinstance(v, float) else v for k, v in r["figures"].items()},
            "server_line": r["server_lines"]["sglang"]}


def _free_port() -> int:
    from mega_async.utils.comm import free_port

    return free_port()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=["train-step", "server-gen"])
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny model on CPU: checks the code, not the figures")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    a = ap.parse_args(argv)
    import torch

    if not a.cpu_dry_run and not torch.cuda.is_available():
        print(json.dumps({"part": a.part, "skipped": "no CUDA device (use --cpu-dry-run to check the code on CPU)"}))
        return 0
    if a.part == "train-step":
        seqs, L = (2, 64) if a.cpu_dry_run else (a.seqs, a.seq_len)
        res = train_step(a.cpu_dry_run, 1 if a.cpu_dry_run else a.steps, seqs, L)
    else:
        res = server_gen(a.cpu_dry_run)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
