"""Run under torchrun by tests/dist/test_replay.py: at a layout, measure the trainer's routing against rollout
routes taken from a transformers forward (its own router's top-k on the same tokens: fp32 on the same weights,
and "foreign" routes from perturbed router weights), with routing replay off and on; then the replayed
logprobs and one decoupled-PPO step with replay on. Rank 0 writes the results."""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_worker import GROUP, synthetic_batch  # noqa: E402

from mega_async.algo.packing import redistribute_groups  # noqa: E402
from mega_async.api.types import WeightVersion
from mega_async.trainer.engine import EngineConfig, MegatronTrainEngine  # noqa: E402
from mega_async.trainer.parallel import destroy_parallel_state  # noqa: E402

VERSION = 2


def _hf_model(model_dir: str, perturb: float = 0.0, rebias: float = 0.0) -> tuple[torch.nn.Module, list]:
    """transformers' model and its routers per layer (None for a dense layer); `perturb` adds noise to the router
    weights, `rebias` to a sigmoid router's e_score_correction_bias (which changes selection, not weights)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gates = [getattr(layer.mlp, "gate", None) for layer in m.model.layers]
    gates = [g if isinstance(g, torch.nn.Module) and hasattr(g, "top_k") else None for g in gates]
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for gate in (x for x in gates if x is not None):
            if perturb:
                gate.weight += perturb * torch.randn(gate.weight.shape, generator=g)
            if rebias:
                gate.e_score_correction_bias += rebias * torch.randn(gate.e_score_correction_bias.shape, generator=g)
    return m, gates


def hf_routes(model_dir: str, batch: dict, perturb: float = 0.0, rebias: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, L, layers, k] top-k experts of each position's forward in transformers; -1 at each sequence's last
    token (never forwarded in a rollout), on padding and in dense layers, as the client stores them. Also
    transformers' logprob of every token ([n, L], 0 on the first), as the engine's compute_logprobs lays it out."""
    m, gates = _hf_model(model_dir, perturb, rebias)
    top_k = next(x for x in gates if x is not None).top_k
    seen: dict[int, torch.Tensor] = {}
    hooks = [gate.register_forward_hook(lambda mod, a, out, i=i: seen.__setitem__(i, out[2]))
             for i, gate in enumerate(gates) if gate is not None]
    n, L = batch["input_ids"].shape
    out = torch.full((n, L, len(gates), top_k), -1, dtype=torch.int32)
    lp = torch.zeros(n, L)
    with torch.no_grad():
        for i in range(n):
            k = int(batch["attention_mask"][i].sum())
            seen.clear()
            ids = batch["input_ids"][i:i + 1, :k]
            logits = m(ids).logits[0].float()
            lp[i, 1:k] = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            for layer, routes in seen.items():
                out[i, :k - 1, layer] = routes[:k - 1].int()
    for h in hooks:
        h.remove()
    return out, lp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from megatron.core import parallel_state as mpu
    from safetensors.torch import save_file

    cfg = EngineConfig.of(lr=0.05, adam_eps=1.0, grad_clip=0.0, prox_logp="recompute", routing_replay=False)
    eng = MegatronTrainEngine(args.model, args.layout, cfg, version=WeightVersion(VERSION))
    batch = synthetic_batch()
    batch["versions"][batch["loss_mask"].bool()] = VERSION  # every output token from the current weights
    (same, hf_lp), (foreign, _) = hf_routes(args.model, batch), hf_routes(args.model, batch, perturb=0.5)
    sigmoid = any(hasattr(g, "e_score_correction_bias") for g in _hf_model(args.model)[1])
    # a sigmoid router's correction bias shifted: other experts are selected, the weights stay the unbiased scores
    rebiased, hf_lp_rebiased = hf_routes(args.model, batch, rebias=0.05) if sigmoid else (same, hf_lp.clone())
    res = {"same_off": eng.routing_mismatch({**batch, "routed_experts": same}),
           "foreign_off": eng.routing_mismatch({**batch, "routed_experts": foreign}),
           "rebiased_off": eng.routing_mismatch({**batch, "routed_experts": rebiased})}
    lp_free = eng.compute_logprobs({**batch, "routed_experts": foreign})
    eng.cfg.algorithm.routing_replay = eng.routing.replay = True
    res["same_on"] = eng.routing_mismatch({**batch, "routed_experts": same})
    res["foreign_on"] = eng.routing_mismatch({**batch, "routed_experts": foreign})
    res["rebiased_on"] = eng.routing_mismatch({**batch, "routed_experts": rebiased})
    lp_replayed = eng.compute_logprobs({**batch, "routed_experts": foreign})
    lp_same = eng.compute_logprobs({**batch, "routed_experts": same})
    lp_rebiased = eng.compute_logprobs({**batch, "routed_experts": rebiased})
    n_groups = batch["input_ids"].shape[0] // GROUP
    tokens = [int(batch["attention_mask"][g * GROUP:(g + 1) * GROUP].sum()) for g in range(n_groups)]
    mine = redistribute_groups(tokens, mpu.get_data_parallel_world_size())[mpu.get_data_parallel_rank()]
    rows = [g * GROUP + j for g in mine for j in range(GROUP)]
    res["train"] = eng.train_batch({k: v[rows] for k, v in {**batch, "routed_experts": foreign}.items()})
    weights = {k: v.contiguous() for k, v in eng.export_hf_weights()}
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        save_file(weights, f"{args.out}/stepped.safetensors")
        save_file({"free": lp_free, "replayed": lp_replayed, "same": lp_same, "mask": batch["loss_mask"].float(),
                   "hf": hf_lp, "rebiased": lp_rebiased, "hf_rebiased": hf_lp_rebiased},
                  f"{args.out}/logprobs.safetensors")
        res["parallel"] = {"tp": mpu.get_tensor_model_parallel_world_size(),  # as run (jobs share a process)
                           "pp": mpu.get_pipeline_model_parallel_world_size(),
                           "ep": mpu.get_expert_model_parallel_world_size(),
                           "vpp": mpu.get_virtual_pipeline_model_parallel_world_size() or 1}
        with open(f"{args.out}/stats.json", "w") as f:
            json.dump(res, f)
    destroy_parallel_state()


if __name__ == "__main__":
    main()
