"""The launcher's plan: which nodes serve and which train, checked against the nodes, the model and GPU
memory with one line naming what does not fit; parameter counts against the models themselves."""
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mega_async.api.allocation import parse_allocation
from mega_async.launch.slurm import fit
from mega_async.launch.slurm.plan import LaunchError, plan_job

ROOT = Path(__file__).resolve().parents[2]
Q30 = AutoConfig.from_pretrained(ROOT / "models" / "qwen3-30b-a3b")
Q235 = AutoConfig.from_pretrained(ROOT / "models" / "qwen3-235b-a22b")


def plan(alloc, nodes, gpus, backend="sglang", cfg=Q30, mem=141.0):
    return plan_job(parse_allocation(alloc), nodes, gpus, backend=backend, hf_config=cfg, gpu_memory_gib=mem)


@pytest.mark.parametrize("card", ["tiny-qwen3-moe", "tiny-qwen3"])
def test_param_count_equals_the_hf_model(card):
    c = AutoConfig.from_pretrained(ROOT / "models" / card)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(c)
    assert fit.count_params(c).total == sum(p.numel() for p in model.parameters())


def test_param_count_of_the_published_cards():
    with torch.device("meta"):  # no memory: shapes only
        m = AutoModelForCausalLM.from_config(Q30)
    assert fit.count_params(Q30).total == sum(p.numel() for p in m.parameters()) == 30_532_122_624  # "30.5B"
    assert fit.count_params(Q235).total == 235_093_634_560  # "235B"
    assert (Q30.num_experts, Q30.num_experts_per_tok, Q30.num_hidden_layers) == (128, 8, 48)
    assert (Q235.hidden_size, Q235.num_hidden_layers, Q235.moe_intermediate_size) == (4096, 94, 1536)


def test_servers_on_their_own_nodes_then_the_trainer():
    p = plan("sglang:d4t4e4+megatron:d8e8", 3, 8)
    assert [(s.nodes, s.base_gpu, s.ep) for s in p.servers] == [((0,), 0, 4), ((0,), 4, 4), ((1,), 0, 4), ((1,), 4, 4)]
    assert p.trainer_nodes == (2,) and p.trainer_tasks_per_node == 8
    assert not p.router  # a router only when asked for (inference.router=smg)
    assert p.servers[0].dp_attention == 1  # tp 4 = KV heads 4: plain TP attention
    lines = p.describe()
    assert any("driver = rank 0 on node 2" in line for line in lines)
    assert [line.split(" (")[0] for line in lines if line.startswith("fit: stage")] == ["fit: stage 0"]  # PP 1


def test_a_server_spanning_nodes_and_dp_attention():
    p = plan("sglang:d1t16e16+megatron:d8e8", 3, 8)
    (s,) = p.servers
    assert s.nodes == (0, 1) and s.gpus == 16 and s.dp_attention == 4  # 16 ranks over 4 KV heads
    assert not p.router and p.trainer_nodes == (2,)
    assert "nodes 0-1 (--nnodes 2)" in p.describe()[1]


def test_one_node_puts_servers_after_the_trainer_gpus():
    p = plan("sglang:d2t2+megatron:d4", 1, 8, cfg=None)
    assert [(s.nodes, s.base_gpu) for s in p.servers] == [((0,), 4), ((0,), 6)] and p.trainer_nodes == (0,)
    cpu = plan("sglang:d1+megatron:d1", 1, 2, backend="embedded", cfg=None)
    assert not cpu.gpu and not cpu.router and cpu.servers[0].base_gpu == 1


@pytest.mark.parametrize("alloc,nodes,gpus,backend,cfg,mem,message", [
    ("sglang:d4t4e4+megatron:d8e8", 4, 8, "sglang", Q30, 141,
     "takes 3 nodes of 8 GPUs (2 for 4 server(s), 1 for the trainer) but --nodes=4: pass --nodes 3"),
    ("sglang:d3t4+megatron:d8", 3, 8, "sglang", None, 141, "3 server(s) x 4 GPUs do not fill whole nodes of 8 GPUs"),
    ("sglang:d1t12+megatron:d8", 3, 8, "sglang", None, 141, "a server of 12 GPUs does not span whole nodes of 8"),
    ("sglang:d1t8+megatron:d4", 2, 8, "sglang", None, 141, "has 4 ranks, not whole nodes of 8 GPUs"),
    ("sglang:d2t2+megatron:d2", 1, 8, "sglang", None, 141, "needs 6 GPUs (2 x 2 for the servers + 2 for the trainer)"),
    ("sglang:d1t2+megatron:d1", 1, 4, "embedded", None, 141, "inference.backend=embedded runs one rank per server"),
    ("sglang:d1t8e3+megatron:d8", 2, 8, "sglang", None, 141, "--ep-size (3) to divide --tp-size (8)"),
    ("sglang:d1t8e8+megatron:d8t3", 2, 8, "sglang", Q30, 141, "tp=3 does not divide num_attention_heads=32"),
    ("sglang:d1t8e8+megatron:d8p5", 2, 8, "sglang", Q30, 141, "does not divide num_hidden_layers=48"),
    ("sglang:d1t8e8+megatron:d8e8", 2, 8, "sglang", Q30, 80,
     "stage 0 needs 100.2 GiB a GPU (state 71.5, activations 28.6)"),
    ("sglang:d1t4e4+megatron:d16p2t4e16", 5, 8, "sglang", Q235, 141, "a server of 4 GPUs holds 109.5 GiB of weights"),
])
def test_what_does_not_fit_is_one_line(alloc, nodes, gpus, backend, cfg, mem, message):
    with pytest.raises(LaunchError) as e:
        plan(alloc, nodes, gpus, backend, cfg, mem)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_memory_estimate_by_hand():
    """Qwen3-30B-A3B at megatron:d8e8: experts 1/8 each with unsharded Adam, dense parts whole with Adam / 8; the
    activations fall with recompute and are not part of the state; the stages of PP2 hold the layers between them."""
    p = fit.count_params(Q30)
    s = parse_allocation("sglang:d1+megatron:d8e8").train
    by_hand = (p.dense * (2 + 4 + 12 / 8) + p.expert / 8 * (2 + 4 + 12)) / 2**30
    fits = {m: fit.trainer_stage_fits(Q30, s, "bfloat16", 4096, m, ("core_attn", "layernorm", "moe"))[0]
            for m in ("none", "selective", "full")}
    assert all(f.state_gib == pytest.approx(by_hand) for f in fits.values())
    assert fits["none"].activation_gib > fits["selective"].activation_gib > fits["full"].activation_gib > 0
    assert fits["full"].recompute_gib > 0 == fits["none"].recompute_gib
    two = fit.trainer_stage_fits(Q30, parse_allocation("sglang:d1+megatron:d4p2e4").train, "bfloat16", 4096)
    assert [(f.stage, f.layers, f.in_flight) for f in two] == [(0, 24, 2), (1, 24, 1)]
    assert fit.server_gib_per_gpu(p, 8, "bfloat16") == pytest.approx(p.total * 2 / 8 / 2**30)
