"""Run under torchrun by tests/dist/test_mtp.py. forward: build the model at a layout from HF weights and run
Megatron's MTP block in training mode through the pipeline schedule (forward only); rank 0 writes the main and MTP
layer's logits (gathered over TP). engine: two PPO steps of the trainer engine (trainer.mtp train or freeze) on
the synthetic RL batch; rank 0 writes the stats and the exported weights."""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from mega_async.trainer.parallel import destroy_parallel_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parity_worker import batch  # noqa: E402


def forward(args: argparse.Namespace) -> None:
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from safetensors.torch import save_file

    from mega_async.trainer.model import build_model
    from mega_async.trainer.mtp import split_output

    models = build_model(args.model, args.layout, load_weights=True)
    for m in models:
        m.train()
        m.mtp_logits = True  # what the trainer engine asks for
    tokens, _ = batch()
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)

    def step(it, model):
        t = next(it)
        out = model(t, pos[: t.shape[0]], None)

        def collect(output, non_loss_data=True):
            logits, mtp = split_output(output)
            return [gather_from_tensor_model_parallel_region(x) for x in [logits, *mtp]]

        return out, collect

    with torch.no_grad():
        outs = get_forward_backward_func()(forward_step_func=step, data_iterator=[iter([tokens]) for _ in models],
                                           model=models, num_microbatches=1, seq_length=tokens.shape[1],
                                           micro_batch_size=tokens.shape[0], forward_only=True,
                                           collect_non_loss_data=True)
    last = mpu.is_pipeline_last_stage(ignore_virtual=True)
    group = mpu.get_pipeline_model_parallel_group()
    got = list(outs[0]) if last else [torch.empty(*tokens.shape, 1024) for _ in range(2)]
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        src = dist.get_global_rank(group, mpu.get_pipeline_model_parallel_world_size() - 1)
        for t in got:
            dist.broadcast(t, src, group=group)
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        save_file({"logits": got[0].contiguous(), "mtp": got[1].contiguous()}, f"{args.out}/mtp.safetensors")
    destroy_parallel_state()


def engine(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    from engine_worker import synthetic_batch
    from mega_async.trainer.engine import EngineConfig, MegatronTrainEngine

    clip = 1.0
    eng = MegatronTrainEngine(args.model, args.layout, EngineConfig.of(
        lr=args.lr, prox_logp="behavior", mtp=args.mtp, grad_clip=clip, mtp_loss_scaling_factor=args.mtp_scale))
    b = synthetic_batch()
    stats = [eng.train_batch(b) for _ in range(2)]
    weights = {k: v.contiguous() for k, v in eng.export_hf_weights()}
    if dist.get_rank() == 0:
        from megatron.core import parallel_state as mpu

        os.makedirs(args.out, exist_ok=True)
        layout = {"tp": mpu.get_tensor_model_parallel_world_size(), "pp": mpu.get_pipeline_model_parallel_world_size(),
                  "ep": mpu.get_expert_model_parallel_world_size(),
                  "etp": mpu.get_expert_tensor_parallel_world_size()}
        with open(f"{args.out}/stats.json", "w") as f:
            json.dump({"stats": stats, "layout": layout}, f)
        save_file(weights, f"{args.out}/weights.safetensors")
    destroy_parallel_state()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["forward", "engine"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mtp", default="train")
    ap.add_argument("--mtp-scale", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    forward(args) if args.mode == "forward" else engine(args)


if __name__ == "__main__":
    main()
