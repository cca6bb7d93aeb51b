"""The DeepSeek-V3, Kimi-K2 and GLM-4.5 cluster recipes: their cards' parameter counts equal the published ones
(computed from config.json, checked against transformers' own model), and `mega-async launch slurm --dry-run`
validates and renders their 141 GB and 80 GB layouts; what does not fit is one line."""
import copy
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mega_async.api.allocation import parse_allocation
from mega_async.cli import main
from mega_async.launch.slurm import fit
from mega_async.launch.slurm.plan import LaunchError, plan_job

ROOT = Path(__file__).resolve().parents[2]
DSV3 = AutoConfig.from_pretrained(ROOT / "models" / "deepseek-v3")
KIMI = AutoConfig.from_pretrained(ROOT / "models" / "kimi-k2-instruct")
GLM = AutoConfig.from_pretrained(ROOT / "models" / "glm-4.5")


def _hf_count(cfg) -> int:
    """transformers' own count: parameters plus the routers' e_score_correction_bias (a buffer there, a tensor of
    the checkpoint); meta device, so no memory."""
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    return (sum(p.numel() for p in m.parameters())
            + sum(b.numel() for n, b in m.named_buffers() if n.endswith("e_score_correction_bias")))


@pytest.mark.parametrize("cfg", [DSV3, KIMI, GLM], ids=["deepseek-v3", "kimi-k2", "glm-4.5"])
def test_the_count_is_transformers_count(cfg):
    """Layers are alike past the dense ones, so the formula is checked on the first dense layers + 2 MoE layers
    (a 671B model on the meta device takes seconds); the full counts follow in the next test."""
    short = copy.deepcopy(cfg)
    short.num_hidden_layers = cfg.first_k_dense_replace + 2
    assert fit.count_params(short).total == _hf_count(short)


@pytest.mark.parametrize("card", ["tiny-deepseek-v3", "tiny-glm4-moe"])
def test_the_count_of_the_tiny_cards(card):
    c = AutoConfig.from_pretrained(ROOT / "models" / card)
    assert fit.count_params(c).total == _hf_count(c)


def published(cfg):
    """The card as the vendor publishes it: DeepSeek-V3 and GLM-4.5 ship one MTP layer (the cards keep it)."""
    c = copy.deepcopy(cfg)
    assert c.num_nextn_predict_layers == 1
    return c


def test_published_parameter_counts():
    """Each vendor's figure, under the convention its report states.
    DeepSeek-V3 (README_WEIGHTS.md): main model 671B with embedding and head; 36.7B (later 36.6B) activated: the
    head included, the embedding lookup not; "37B" in the paper; MTP module 11.5B more (we count 11.6B).
    Kimi-K2 (model card): "1T total, 32B activated", the same convention as DeepSeek's.
    GLM-4.5 (report): "355B total, 32B activated" counts without embedding and head, the MTP layer included."""
    d, k, g = fit.count_params(published(DSV3)), fit.count_params(KIMI), fit.count_params(published(GLM))
    assert d.total == 671_026_419_200 and round(d.total / 1e9) == 671
    assert d.active == 36_625_618_432 and round(d.active / 1e8) == 366 and round(d.active / 1e9) == 37
    assert round(d.mtp / 1e9, 1) == 11.6 and d.expert_active == 58 * 8 * 3 * 7168 * 2048
    assert k.total == 1_026_408_232_448 and round(k.total / 1e12) == 1 and round(k.active / 1e9) == 32
    assert k.mtp == 0 and KIMI.n_routed_experts == 384 and KIMI.n_group == KIMI.topk_group == 1
    assert g.total == 352_797_829_024
    assert round((g.non_embedding + g.mtp) / 1e9) == 355 and round((g.active - g.head) / 1e9) == 32
    assert (GLM.num_hidden_layers, GLM.first_k_dense_replace, GLM.n_routed_experts) == (92, 3, 160)


def test_fp8_checkpoints_hold_one_byte_a_weight_on_the_servers():
    d = fit.count_params(DSV3)
    assert fit.fp8_block_size(DSV3) == fit.fp8_block_size(KIMI) == (128, 128) and fit.fp8_block_size(GLM) is None
    bf16 = fit.server_gib_per_gpu(d, 8, "bfloat16")
    fp8 = fit.server_gib_per_gpu(d, 8, "bfloat16", fp8=True)
    by_hand = ((d.total - 2 * d.embed) * (1 + 4 / 128**2) + 2 * d.embed * 2) / 8 / 2**30
    assert fp8 == pytest.approx(by_hand) and fp8 == pytest.approx(78.4, abs=0.05) and bf16 > 156


# recipe -> (141 GB: nodes, servers, server tp, dp-attention, trainer ranks), (80 GB: overrides, the same)
RECIPES = {
    "deepseek_v3_gsm8k_18x8.yaml": ((18, 2, 8, 8, 128),
                                    (["--nodes", "36", "parallel.allocation=sglang:d2t16e16+megatron:d32t8e256"],
                                     (36, 2, 16, 16, 256))),
    "kimi_k2_gsm8k_28x8.yaml": ((28, 2, 16, 16, 192),
                                (["--nodes", "52", "parallel.allocation=sglang:d1t32e32+megatron:d48t8e384"],
                                 (52, 1, 32, 32, 384))),
    "glm45_355b_a32b_gsm8k_10x8.yaml": ((10, 2, 8, 1, 64),
                                        (["--nodes", "20", "parallel.allocation=sglang:d2t16e16+megatron:d4p4t8e32"],
                                         (20, 2, 16, 2, 128))),
}


def dry_run(capsys, config, *args):
    rc = main(["launch", "slurm", "-c", str(ROOT / "configs" / config), "--dry-run", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err.strip()


@pytest.mark.parametrize("gpu", ["141", "80"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipes_validate_and_render(capsys, recipe, gpu):
    big, (overrides, small) = RECIPES[recipe]
    args = [] if gpu == "141" else [*overrides, "launch.gpu_memory_gib=80"]
    nodes, n_servers, tp, dp_attn, ranks = big if gpu == "141" else small
    rc, script, err = dry_run(capsys, recipe, *args)
    assert rc == 0, err
    assert f"#SBATCH --nodes={nodes}" in script and "#SBATCH --gpus-per-node=8" in script
    launches = re.findall(r"sglang\.launch_server .*", script)
    assert len(launches) == n_servers
    for line in launches:
        assert f"--tp-size {tp} " in line and f"--ep-size {tp} " in line
        assert (f"--dp-size {dp_attn} --enable-dp-attention" in line) == (dp_attn > 1)
        assert ("--nnodes" in line) == (tp > 8)
    assert f"TRAINER_RANKS={ranks}" in script and "TRAINER_TASKS_PER_NODE=8" in script


@pytest.mark.parametrize("recipe,args,message", [
    # the 141 GB layouts on 80 GB GPUs
    ("deepseek_v3_gsm8k_18x8.yaml", ["launch.gpu_memory_gib=80"],
     "a server of 8 GPUs holds 87.7 GiB of FP8 weights per GPU, over 70% of a 80 GiB GPU"),  # MLA whole (DP attn)
    ("deepseek_v3_gsm8k_18x8.yaml", ["--nodes", "20", "launch.gpu_memory_gib=80",
                                     "parallel.allocation=sglang:d2t16e16+megatron:d16t8e128"],
     "trainer megatron:d16p1t8e128: pipeline stage 0 needs 109.5 GiB a GPU (state 106.6, activations 2.9)"),
    ("glm45_355b_a32b_gsm8k_10x8.yaml", ["launch.gpu_memory_gib=80"], "holds 82.1 GiB of weights per GPU"),
    # 61 layers: no pipeline split; 384 experts, 8 KV heads
    ("deepseek_v3_gsm8k_18x8.yaml", ["parallel.allocation=sglang:d2t8e8+megatron:d8p2t8e64"],
     "pp x vpp = 2 x 1 = 2 does not divide num_hidden_layers=61"),
    ("kimi_k2_gsm8k_28x8.yaml", ["--nodes", "36", "parallel.allocation=sglang:d2t16e16+megatron:d32t8e256"],
     "ep=256 does not divide num_experts=384"),
    ("glm45_355b_a32b_gsm8k_10x8.yaml", ["--nodes", "10", "parallel.allocation=sglang:d2t8e8+megatron:d1p4t16e16"],
     "tp=16 does not divide num_key_value_heads=8"),
    # servers on an FP8 checkpoint load FP8 blocks; a bf16 checkpoint has none to send
    ("deepseek_v3_gsm8k_18x8.yaml", ["trainer.sync_weight_format=model_dtype"],
     "is an FP8 block checkpoint: the SGLang servers started on it load FP8 weights with their weight_scale_inv"),
    ("glm45_355b_a32b_gsm8k_10x8.yaml", ["trainer.sync_weight_format=fp8_block"],
     "trainer.sync_weight_format=fp8_block needs model.path=models/glm-4.5 to be an FP8 block checkpoint"),
])
def test_what_does_not_fit_is_one_line(capsys, recipe, args, message):
    rc, script, err = dry_run(capsys, recipe, *args)
    assert rc == 2 and script == "" and "\n" not in err and message in err, err


def test_published_mtp_layers_pass_the_dry_run(capsys):
    """The published DeepSeek-V3 config (num_nextn_predict_layers 1, as the card keeps it) plans a job: its MTP layer
    is built, trained and synced (mega_async.trainer.mtp)."""
    assert '"num_nextn_predict_layers": 1' in (ROOT / "models" / "deepseek-v3" / "config.json").read_text()
    rc, script, err = dry_run(capsys, "deepseek_v3_gsm8k_18x8.yaml")
    assert rc == 0 and "#SBATCH --nodes=18" in script, err


def test_mla_servers_run_attention_data_parallel():
    """MLA's KV cache is one latent head: an expert-parallel DeepSeek server gets DP attention over all its ranks
    (SGLang's DeepSeek recipe), GQA keeps tp / kv_heads (GLM-4.5: 8 KV heads)."""
    p = plan_job(parse_allocation("sglang:d1t16e16+megatron:d16t8e128"), 18, 8, backend="sglang", hf_config=DSV3,
                 gpu_memory_gib=141)
    assert p.servers[0].dp_attention == 16 and p.servers[0].nodes == (0, 1)
    p = plan_job(parse_allocation("sglang:d2t8e8+megatron:d2p4t8e16"), 10, 8, backend="sglang", hf_config=GLM,
                 gpu_memory_gib=141)
    assert [s.dp_attention for s in p.servers] == [1, 1]
    with pytest.raises(LaunchError, match="tp=12 does not divide num_attention_heads=128"):
        plan_job(parse_allocation("sglang:d1t12e4+megatron:d16t8e128"), 18, 8, backend="sglang", hf_config=DSV3)
