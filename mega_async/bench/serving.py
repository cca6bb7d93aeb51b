"""Generation throughput of the server a run launches (the `serve:` scenarios of configs/bench/, and
tools/bench_gpu.py's server-gen part).

The server is the one `mega-async train` would start for the run config named: `run_server_spec` builds it from the
config's inference section (backend, dtype, radix cache, `inference.extra_args`, routed experts when the run
collects them) with TP = EP = as many GPUs as are visible and the model's experts divide (at most the
allocation's server width), as the local launcher does. The model is a Qwen3-MoE card of the scenario's size with
random weights (no model hub on the benchmark machines), or the tiny card. Every request goes through the
project's client, all at once, EOS ignored: generated tokens per second over the wall clock of the whole batch.
Each engine in `engines` is measured in turn on the same requests; the first over the last is the ratio figure
(real SGLang against the embedded server, measured in the same run).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional, Sequence

logger = logging.getLogger("mega_async.bench.serving")
ROOT = Path(__file__).resolve().parents[2]

ENGINES = ("sglang", "embedded")
# ~1B active of ~2.7B total: 16 layers, hidden 2048, 16 experts (top 4) of 1536, vocab 32k
MOE_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
              intermediate_size=6144, moe_intermediate_size=1536, num_experts=16, num_experts_per_tok=4,
              vocab_size=32768, max_position_embeddings=8192)
SIZES = {"moe_1b": MOE_1B, "tiny": None}


def bench_model(size: str, out: Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """A Qwen3-MoE model directory of `size` (SIZES) with random weights, the tiny card's tokenizer; `tiny` is the
    tiny card itself (its own weights). Weights are drawn on the GPU when there is one (seconds for ~2.7B)."""
    import torch
    from safetensors.torch import save_file

    from mega_async.bridge.model_cards import TINY_MOE, copy_model_files, init_random_weights

    if size not in SIZES:
        raise ValueError(f"serve.model={size!r}: use one of {sorted(SIZES)}")
    if SIZES[size] is None:
        return init_random_weights(TINY_MOE, out, seed=seed)
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    out.mkdir(parents=True, exist_ok=True)
    copy_model_files(TINY_MOE, out, skip=("config.json", "model.safetensors", "model.safetensors.index.json"))
    cfg = Qwen3MoeConfig(**SIZES[size], rms_norm_eps=1e-6, tie_word_embeddings=False, norm_topk_prob=True,
                         decoder_sparse_step=1, mlp_only_layers=[], dtype=dtype)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=getattr(torch, dtype))
        else:
            t = (torch.randn(shape, generator=g, device=dev) * 0.02).to(getattr(torch, dtype)).cpu()
        tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    return out


def server_width(gpus: int, experts: int, allocation_width: int) -> int:
    """TP = EP of the benchmark's server: the most of `gpus` (at most the allocation's server width) that divides
    the experts; 1 without GPUs (CPU: one rank)."""
    n = max(1, min(gpus, allocation_width))
    while n > 1 and experts % n:
        n -= 1
    return n


def bench_server_spec(config: str | Path, model: Path, engine: str, gpus: int, batch: int) -> Any:
    """The ServerSpec of the benchmark's one server: the run's own (`run_server_spec`) for `engine`, TP = EP =
    `server_width` on `gpus` GPUs (real SGLang on its CPU engine without one)."""
    from mega_async.api.config_load import load_config
    from mega_async.inference.servers import run_server_spec
    from mega_async.inference.service import server_layout

    cfg = load_config(resolve(config), [f"model.path={model}", f"inference.backend={engine}",
                                        "inference.addresses=[]"])
    experts = json.loads((Path(model) / "config.json").read_text()).get("num_experts", 1)
    _, tp, _ = server_layout(cfg)
    width = server_width(gpus, experts, tp) if engine == "sglang" else 1
    device = None if gpus else ("cpu" if engine == "sglang" else None)
    spec = run_server_spec(cfg, num_servers=1, host="127.0.0.1", tp=width, ep=width, device=device,
                           base_gpu_id=0 if gpus and engine == "sglang" else None)
    if engine == "embedded":  # the recipe's extra_args are SGLang's flags; the baseline takes its own
        spec.extra_args = ["--device", "cuda" if gpus else "cpu", "--max-running-requests", str(batch)]
    return spec


def measure_engine(config: str | Path, model: Path, engine: str, *, batch: int, new_tokens: int,
                   prompt_len: int = 32, startup_timeout: float = 900.0,
                   log_dir: Optional[Path] = None) -> dict[str, Any]:
    """One server of `engine` for the run config `config` serving `model`: tokens/s of `batch` requests at once."""
    import torch

    from mega_async.api.types import ModelRequest
    from mega_async.inference.client import SGLangClient
    from mega_async.inference.servers import ServerLauncher, server_command

    spec = bench_server_spec(config, model, engine, torch.cuda.device_count(), batch)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, min(vocab, 1000), (batch, prompt_len), generator=g).tolist()
    with ServerLauncher(spec, startup_timeout=startup_timeout,
                        log_dir=str(log_dir) if log_dir else None) as launcher:
        line = " ".join(server_command(launcher.spec, 0)).replace(" --port 0 ", " --port <port> ")
        client = SGLangClient(launcher.addresses)

        async def run(ps: list[list[int]], n: int) -> float:
            reqs = [ModelRequest(input_ids=p, max_new_tokens=n, temperature=1.0, ignore_eos=True) for p in ps]
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(client.agenerate(r) for r in reqs))
            short = [len(o.output_tokens) for o in outs if len(o.output_tokens) != n]
            if short:
                raise RuntimeError(f"{engine}: {len(short)} of {len(ps)} requests returned {short[:4]} tokens, not "
                                   f"{n} (ignore_eos was set)")
            return len(ps) * n / (time.perf_counter() - t0)

        asyncio.run(run(prompts[:2], 8))  # warm-up (kernels, CUDA graphs' first batch)
        tps = asyncio.run(run(prompts, new_tokens))
    return {"engine": engine, "tokens_per_s": tps, "tp": spec.tp_size, "ep": spec.ep_size, "server_line": line}


def serve_figures(serve: dict[str, Any], work: Path, engines: Sequence[str] = ENGINES) -> dict[str, Any]:
    """One repeat of a `serve:` scenario: `<engine>_gen_tokens_per_s` per engine and, with two engines, the
    first's over the second's (`<a>_over_<b>`); the first engine's TP/EP and command line for the record."""
    from mega_async.api.config_load import load_config

    size = serve.get("model", "tiny")
    model = bench_model(size, work / f"model_{size}", dtype=load_config(resolve(serve["config"])).model.dtype)
    figs: dict[str, Any] = {}
    lines = {}
    for engine in engines:
        r = measure_engine(serve["config"], model, engine, batch=int(serve.get("batch", 64)),
                           new_tokens=int(serve.get("new_tokens", 256)), log_dir=work / f"logs_{engine}")
        figs[f"{engine}_gen_tokens_per_s"] = r["tokens_per_s"]
        lines[engine] = r
        logger.info("serve %s: %.1f tokens/s (tp %d, ep %d): %s", engine, r["tokens_per_s"], r["tp"], r["ep"],
                    r["server_line"])
    if len(engines) == 2:
        a, b = engines
        figs[f"{a}_over_{b}"] = figs[f"{a}_gen_tokens_per_s"] / figs[f"{b}_gen_tokens_per_s"]
    first = lines[engines[0]]
    figs["server_tp"], figs["server_ep"] = first["tp"], first["ep"]
    return {"figures": figs, "server_lines": {e: r["server_line"] for e, r in lines.items()}}


def cpu_dry_run(serve: dict[str, Any]) -> dict[str, Any]:
    """The scenario's code on CPU: the tiny card, the tiny real-SGLang config, a few short requests."""
    return {**serve, "config": "configs/tiny_cpu_sglang.yaml", "model": "tiny", "batch": 4, "new_tokens": 8}


def resolve(config: str) -> Path:
    """A run config named in a scenario: as given, else under the repository root."""
    p = Path(config)
    return p if p.is_absolute() or p.exists() else ROOT / p
