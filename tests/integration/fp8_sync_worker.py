"""One trainer rank (Megatron, fp32, loaded dequantized from a tiny FP8 block card) and one embedded server started
on that card: the server's logprobs at start, after a distributed FP8 sync and after a disk FP8 sync, each beside
a transformers forward of the reference weights (what the server should hold) and of the trainer's own weights
(the FP8 gap), written as JSON."""
import argparse
import asyncio
import json
from pathlib import Path

import torch

from mega_async.bridge import fp8
from mega_async.trainer.weights import export_hf_weights
from mega_async.inference.client import SGLangClient
from mega_async.inference.servers import ServerLauncher, ServerSpec
from mega_async.trainer.model import build_model
from mega_async.trainer.sync import disk_sync, distributed_sync, RolloutSide
from mega_async.api.types import WeightVersion

PROMPTS = [[3, 14, 15, 92, 65, 35], [7, 7, 100, 2], [500, 1, 9, 26, 5, 3, 58]]


def served(client: SGLangClient) -> list[dict]:
    out = []
    for p in PROMPTS:
        r = asyncio.run(client.generate_on(0, {"input_ids": p, "return_logprob": True, "sampling_params": {
            "max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}}))
        out.append({"prompt": p, "tokens": r["output_ids"],
                    "logprobs": [x[0] for x in r["meta_info"]["output_token_logprobs"]]})
    return out


def hf_logprobs(card: Path, tensors: dict, rows: list[dict]) -> list[list[float]]:
    """log_softmax of each sampled token under a transformers model holding `tensors` (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(card)
    del cfg.quantization_config
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    from mega_async.server.weights import load_named_tensors
    from mega_async.bridge.model_cards import append_mtp_layers

    append_mtp_layers(cfg, m)  # the card's MTP layer (as published) is held too; the forward does not run it

    load_named_tensors(m, tensors.items(), strict=True)
    out = []
    with torch.no_grad():
        for r in rows:
            ids = r["prompt"] + r["tokens"]
            lp = torch.log_softmax(m(torch.tensor([ids])).logits[0].float(), -1)[len(r["prompt"]) - 1:-1]
            out.append(lp.gather(1, torch.tensor(r["tokens"])[:, None]).squeeze(1).tolist())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--card", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    card, root = Path(args.card), Path(args.root)
    block = fp8.dir_block(card)
    models = build_model(str(card), "megatron:d1", dtype=torch.float32, load_weights=True)
    spec = ServerSpec("embedded", str(card), num_servers=1, num_threads=1, weights_root=str(root))
    result: dict = {"block": list(block)}
    with ServerLauncher(spec, log_dir=str(root / "logs"), startup_timeout=120) as launcher:
        version = WeightVersion()
        client = SGLangClient(launcher.addresses, version=version)
        rows = served(client)
        start = dict(fp8.dequantize_named(_stored(card), block))
        result["start"] = {"served": rows, "reference": hf_logprobs(card, start, rows)}
        for mode in ("distributed", "disk"):
            with torch.no_grad():  # a "training step": fp32 weights off the FP8 grid
                for p in models[0].parameters():
                    p.add_(0.02 * torch.randn_like(p))
            trainer = {n: t.float() for n, t in export_hf_weights(models)}
            kw = dict(timeout=60, weight_format="fp8_block", verify_method="checksum")
            if mode == "distributed":
                sync = distributed_sync(models, version, RolloutSide(client), launcher.addresses,
                                             bucket_bytes=64 << 10, **kw)
            else:
                sync = disk_sync(models, version, RolloutSide(client), root / "weights", src_dir=str(card), **kw)
            stats = sync.push()
            sync.verify()
            rows = served(client)
            expect = dict(fp8.dequantize_named(fp8.quantize_named(trainer.items(), block), block))
            result[mode] = {"served": rows, "reference": hf_logprobs(card, expect, rows),
                            "trainer": hf_logprobs(card, trainer, rows), "version": version.value,
                            "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))}}
            if mode == "disk":
                written = sync.transport.path(version.value)
                result["disk_dir"] = {"config": json.loads((written / "config.json").read_text()),
                                      "fp8": sorted(n for n, t in _stored(written) if t.dtype == torch.float8_e4m3fn),
                                      "scales": sorted(n for n, _ in _stored(written) if n.endswith("_scale_inv"))}
            sync.close()
        asyncio.run(client.aclose())
    Path(args.out).write_text(json.dumps(result))


def _stored(d: Path):
    from mega_async.server.weights import read_safetensors_dir

    return list(read_safetensors_dir(d))


if __name__ == "__main__":
    main()
