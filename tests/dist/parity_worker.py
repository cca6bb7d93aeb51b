"""Run under torchrun by tests/dist: build a Megatron model at a layout from HF weights, then
(1) forward logits through Megatron's schedule, (2) HF export, (3) one SGD step with Megatron
DDP + the distributed optimizer (Adam, eps=1) on a token-mean cross entropy, (4) HF export after the step.
Rank 0 writes the results as safetensors for the test to compare against independent references.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist

from mega_async.trainer.weights import export_hf_weights
from mega_async.trainer.model import build_model
from mega_async.trainer.parallel import destroy_parallel_state


def batch(n_seq: int = 4, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 1000, (n_seq, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--microbatches", type=int, default=1)
    args = ap.parse_args()

    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from safetensors.torch import save_file

    models = build_model(args.model, args.layout, load_weights=True)
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)
    tokens, labels = batch()
    seq = tokens.shape[1]
    pos = torch.arange(seq).expand_as(tokens)
    fwd_bwd = get_forward_backward_func()
    last = mpu.is_pipeline_last_stage(ignore_virtual=True)

    # (1) forward logits (every DP replica runs the full batch)
    def fwd_step(it, model):
        t = next(it)
        out = model(t, pos[: t.shape[0]], None)

        def collect(output, non_loss_data=True):
            return gather_from_tensor_model_parallel_region(output)

        return out, collect

    M = args.microbatches
    mbs = list(tokens.chunk(M))
    outs = fwd_bwd(forward_step_func=fwd_step, data_iterator=[iter(mbs) for _ in models], model=models,
                   num_microbatches=M, seq_length=seq, micro_batch_size=mbs[0].shape[0], forward_only=True,
                   collect_non_loss_data=True)
    logits = torch.cat(list(outs)) if last else torch.empty(tokens.shape[0], seq, 1024)
    # send the last stage's logits to rank 0
    src = dist.get_global_rank(mpu.get_pipeline_model_parallel_group(), mpu.get_pipeline_model_parallel_world_size() - 1)
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        shape = torch.tensor(list(logits.shape))
        dist.broadcast(shape, src, group=mpu.get_pipeline_model_parallel_group())
        if not last:
            logits = torch.empty(*shape.tolist())
        dist.broadcast(logits, src, group=mpu.get_pipeline_model_parallel_group())
    if rank == 0:
        save_file({"logits": logits.contiguous()}, f"{args.out}/logits.safetensors")

    # (2) export
    exported = {k: v.contiguous() for k, v in export_hf_weights(models)}
    if rank == 0:
        save_file(exported, f"{args.out}/export.safetensors")

    # (3) one training step: token-mean CE over the global batch, DP-sliced, DDP + distributed optimizer
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    ddp = [DistributedDataParallel(config=m.config, ddp_config=ddp_cfg, module=m) for m in models]
    # Adam (the distributed optimizer's only choice) with eps=1: the first step is lr * g / (|g| + 1), smooth
    # in g, so tiny cross-layout rounding differences stay tiny (eps=1e-8 would turn them into sign flips)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.0, clip_grad=0.0,
                                                 adam_eps=1.0, use_distributed_optimizer=True), ddp)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    per = tokens.shape[0] // dp
    my_tokens, my_labels = tokens[dp_rank * per:(dp_rank + 1) * per], labels[dp_rank * per:(dp_rank + 1) * per]

    def train_step(it, model):
        t, lab = next(it)
        per_token = model(t, pos[: t.shape[0]], None, labels=lab)  # [b, s] CE from vocab-parallel logits

        def loss_fn(per_token_loss):
            # token sum + count: Megatron divides the gradients by the global token count (all DP ranks)
            n = torch.tensor(per_token_loss.numel(), dtype=torch.int)
            return per_token_loss.sum(), n, {"loss": per_token_loss.sum().detach()}

        return per_token, loss_fn

    for m in ddp:
        m.zero_grad_buffer()
    opt.zero_grad()
    pairs = list(zip(my_tokens.chunk(M), my_labels.chunk(M)))
    fwd_bwd(forward_step_func=train_step, data_iterator=[iter(pairs) for _ in ddp], model=ddp,
            num_microbatches=len(pairs), seq_length=seq, micro_batch_size=pairs[0][0].shape[0], forward_only=False)
    ok, grad_norm, _ = opt.step()
    assert ok, "optimizer step failed"
    stepped = {k: v.contiguous() for k, v in export_hf_weights(models)}
    if rank == 0:
        save_file(stepped, f"{args.out}/stepped.safetensors")
        with open(f"{args.out}/parallel.json", "w") as f:  # the layout it really ran at (jobs share a process)
            json.dump({"tp": mpu.get_tensor_model_parallel_world_size(),
                       "pp": mpu.get_pipeline_model_parallel_world_size(),
                       "ep": mpu.get_expert_model_parallel_world_size(),
                       "etp": mpu.get_expert_tensor_parallel_world_size(),
                       "vpp": mpu.get_virtual_pipeline_model_parallel_world_size() or 1}, f)
    destroy_parallel_state()


if __name__ == "__main__":
    main()
