"""Run under torchrun (tests/dist/jobs.py) by tests/dist/test_layout_parity.py: the trainer engine at one layout,
`--steps` PPO steps on the synthetic RL batch with gradient clipping active. Rank 0 writes stats.json (every step's
statistics, the layout, what differed between replicas), grads.safetensors (step 1's reduced gradients, HF-named
and gathered over TP/EP/PP as the weights are) and weights.safetensors (the weights after the last step).

The gradients are read where the optimizer reads them, just before its first step: Megatron's distributed optimizer
leaves each data-parallel rank only its own shard of a reduced bucket, so the shards are gathered back over the
bucket's group first (the step itself reads only the own shard and is not changed by it)."""
import argparse
import hashlib
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

from mega_async.trainer.parallel import destroy_parallel_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_worker import synthetic_batch  # noqa: E402


def gather_reduced_grads(eng) -> None:
    """Every bucket's reduced gradient whole on every rank of its group (the reduce-scatter left one shard each)."""
    for ddp in eng.ddp:
        for bg in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
            group = bg.intra_distributed_optimizer_instance_group
            n = group.size()
            if n == 1:
                continue
            for b in bg.buckets:
                shard = b.grad_data.view(n, -1)[group.rank()].clone()
                dist.all_gather_into_tensor(b.grad_data, shard, group=group)


def hf_grads(eng) -> dict[str, torch.Tensor]:
    """The models' main_grad as HF-named full tensors: swapped into the parameters for one export."""
    saved = []
    for m in eng.models:
        for p in m.parameters():
            if getattr(p, "main_grad", None) is not None:
                saved.append((p, p.data))
                p.data = p.main_grad.view_as(p).to(p.dtype)
    try:
        return {k: v.clone().contiguous() for k, v in eng.export_hf_weights()}
    finally:
        for p, data in saved:
            p.data = data


def _in_core_attention() -> bool:
    return any(f.filename.endswith("mega_async/trainer/attention.py") for f in traceback.extract_stack(limit=12))


class SavedForBackward:
    """Bytes of the tensors autograd keeps for the backward, saved during the first micro-batch's forward (until
    the first backward unpacks one): each storage once, the parameters and their gradient buffers left out. What
    `launch/slurm/fit.py`'s activation estimate counts."""

    def __init__(self, models) -> None:
        self.params = {t.untyped_storage().data_ptr() for m in models for p in m.parameters()
                       for t in (p, getattr(p, "main_grad", None)) if t is not None}
        self.seen: dict[int, int] = {}
        self.core_attention = 0  # of which saved inside the core attention (on a CPU: mega_async's eager kernel)
        self.forward = True

    def pack(self, t):
        if self.forward and isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st.data_ptr() not in self.params and st.data_ptr() not in self.seen:
                self.seen[st.data_ptr()] = st.nbytes()
                if _in_core_attention():
                    self.core_attention += st.nbytes()
        return t

    def unpack(self, t):
        self.forward = False
        return t

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())


def replica_differences(eng) -> list[str]:
    """Parameters whose value differs between the ranks that hold the same shard of them: dense ones over the
    data-parallel group (and, when not tensor-split, over the tensor-parallel group), experts over the
    expert-data-parallel group. Names are local (Megatron's)."""
    from megatron.core import parallel_state as mpu

    groups = {"dp": mpu.get_data_parallel_group(with_context_parallel=True), "tp": mpu.get_tensor_model_parallel_group(),
              "edp": mpu.get_expert_data_parallel_group()}
    out = []
    for i, m in enumerate(eng.models):
        for name, p in m.named_parameters():
            expert = ".experts." in name
            kinds = ["edp"] if expert else ["dp"] + ([] if getattr(p, "tensor_model_parallel", False) else ["tp"])
            digest = hashlib.sha256(p.detach().float().contiguous().numpy().tobytes()).hexdigest()
            for kind in kinds:
                g = groups[kind]
                if dist.get_world_size(g) == 1:
                    continue
                every = [None] * dist.get_world_size(g)
                dist.all_gather_object(every, digest, group=g)
                if len(set(every)) > 1:
                    out.append(f"{kind}:{i}:{name}")
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, out)
    return sorted({x for per in every for x in per})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--clip", type=float, default=0.05)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--unpatched", action="store_true", help="without mcore_fixes' expert marking (to show it matters)")
    ap.add_argument("--recompute", default="none", help="trainer.recompute; selective recomputes --modules")
    ap.add_argument("--modules", default="core_attn,layernorm,mlp", help="trainer.recompute_modules, comma-separated")
    ap.add_argument("--measure", action="store_true", help="activations.json: what the first micro-batch's forward "
                                                           "left for the backward")
    args = ap.parse_args()
    if args.unpatched:
        import mega_async.trainer.model as model_module

        model_module.mark_expert_gradients = lambda models: 0
    from megatron.core import parallel_state as mpu
    from safetensors.torch import save_file

    from mega_async.trainer.engine import EngineConfig, MegatronTrainEngine

    recompute = {"recompute": args.recompute}
    if args.recompute == "selective":
        recompute["recompute_modules"] = args.modules.split(",")
    eng = MegatronTrainEngine(args.model, args.layout, EngineConfig.of(lr=args.lr, prox_logp="behavior",
                                                                      grad_clip=args.clip, **recompute))
    grads: dict[str, torch.Tensor] = {}
    step = eng.optimizer.step

    def capture_then_step(*a, **kw):
        if not grads:
            gather_reduced_grads(eng)
            grads.update(hf_grads(eng))
        return step(*a, **kw)

    eng.optimizer.step = capture_then_step
    b = synthetic_batch()
    kept = None
    if args.measure:
        kept = SavedForBackward(eng.models)
        with torch.autograd.graph.saved_tensors_hooks(kept.pack, kept.unpack):
            stats = [eng.train_batch(b)]
    stats = ([] if kept is None else stats) + [eng.train_batch(b) for _ in range(args.steps - (kept is not None))]
    weights = {k: v.contiguous() for k, v in eng.export_hf_weights()}
    replicas = replica_differences(eng)
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        layout = {"tp": mpu.get_tensor_model_parallel_world_size(), "pp": mpu.get_pipeline_model_parallel_world_size(),
                  "ep": mpu.get_expert_model_parallel_world_size(), "etp": mpu.get_expert_tensor_parallel_world_size(),
                  "dp": mpu.get_data_parallel_world_size()}
        with open(f"{args.out}/stats.json", "w") as f:
            json.dump({"stats": stats, "layout": layout, "replicas": replicas}, f)
        save_file(grads, f"{args.out}/grads.safetensors")
        if kept is not None:
            with open(f"{args.out}/activations.json", "w") as f:
                json.dump({"bytes": kept.bytes, "core_attention": kept.core_attention,
                           "tokens": int(b["attention_mask"].sum())}, f)
        save_file(weights, f"{args.out}/weights.safetensors")
    destroy_parallel_state()


if __name__ == "__main__":
    main()
