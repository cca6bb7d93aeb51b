"""The per-family bridge knowledge without building a model: what DeepSeek-V3 / GLM-4.5 configs are refused (one
line naming the field and the fix), the TransformerConfig overrides mbridge lacks (group-limited top-k, GLM's
shared-expert width and q/k/v bias, no rope mscale without YaRN), the fields transformers 5 moved, and the local
spec's MLA names -> mbridge's. The Megatron/transformers parity of the tiny cards is tests/dist/test_parity_families.py."""
import json
import shutil

import pytest
from transformers import AutoConfig

from mega_async.bridge.families import Family, UnsupportedModelError, check_model, family_for
from mega_async.api.config import ConfigError
from mega_async.api.config_load import load_config
from mega_async.bridge.model_cards import TINY_DEEPSEEK, TINY_GLM, TINY_MOE


def card(tmp_path, base, **changes):
    d = tmp_path / base.name
    shutil.copytree(base, d, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_the_tiny_cards_pass_and_pick_their_family():
    for path, name in ((TINY_DEEPSEEK, "DeepseekV3"), (TINY_GLM, "Glm4Moe"), (TINY_MOE, "Family")):
        hf = AutoConfig.from_pretrained(path)
        check_model(hf)
        assert type(family_for(hf)).__name__ == name


@pytest.mark.parametrize("base, changes, words", [
    (TINY_GLM, {"tie_word_embeddings": True}, ["num_nextn_predict_layers=1 with tie_word_embeddings=true",
                                                "set num_nextn_predict_layers to 0"]),
    (TINY_DEEPSEEK, {"norm_topk_prob": False}, ["norm_topk_prob=false"]),
    (TINY_DEEPSEEK, {"num_experts_per_tok": 6}, ["num_experts_per_tok=6, topk_group=2", "2 x topk_group"]),
    (TINY_DEEPSEEK, {"n_group": 3}, ["n_group=3 does not divide n_routed_experts=16"]),
    (TINY_DEEPSEEK, {"rope_interleave": False}, ["rope_interleave=false"]),
    (TINY_DEEPSEEK, {"attention_bias": True}, ["attention_bias=true"]),
])
def test_refusals_name_the_field_and_the_fix(tmp_path, base, changes, words):
    d = card(tmp_path, base, **changes)
    with pytest.raises(UnsupportedModelError) as e:
        check_model(AutoConfig.from_pretrained(d))
    msg = str(e.value)
    assert "\n" not in msg and str(d / "config.json") in msg
    assert all(w in msg for w in words), msg


def test_transformers_default_mtp_layer_is_built_when_the_config_omits_the_field(tmp_path):
    """Glm4MoeConfig and DeepseekV3Config default to one MTP layer: a config without the field asks for it, and
    Megatron builds it (mega_async.trainer.mtp)."""
    d = card(tmp_path, TINY_GLM)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_nextn_predict_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    hf = AutoConfig.from_pretrained(d)
    check_model(hf)
    assert family_for(hf).overrides(family_for(hf).prepare(hf), use_te=False)["mtp_num_layers"] == 1


@pytest.mark.parametrize("layers, want", [(1, 1), (0, None)])
def test_run_config_load_takes_a_card_with_or_without_mtp_layers(tmp_path, layers, want):
    from mega_async.run.loop import check_inputs

    d = card(tmp_path, TINY_DEEPSEEK, num_nextn_predict_layers=layers)
    check_inputs(load_config(None, [f"model.path={d}", f"logging.root_dir={tmp_path}"]))
    hf = AutoConfig.from_pretrained(d)
    assert family_for(hf).overrides(hf, use_te=False)["mtp_num_layers"] == want


def test_mtp_keys_are_validated(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.mtp='skip'"):
        load_config(None, ["trainer.mtp=skip", f"logging.root_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"trainer.mtp_loss_scaling_factor=-0.1 must be >= 0"):
        load_config(None, ["trainer.mtp_loss_scaling_factor=-0.1", f"logging.root_dir={tmp_path}"])


def test_overrides_and_moved_fields():
    ds = AutoConfig.from_pretrained(TINY_DEEPSEEK)
    fam = family_for(ds)
    fam.prepare(ds)
    o = fam.overrides(ds, use_te=True)
    assert (o["moe_router_num_groups"], o["moe_router_group_topk"]) == (4, 2)  # mbridge leaves groups off
    assert o["moe_router_topk_scaling_factor"] == 2.5 and o["mtp_num_layers"] == 1  # the card's MTP layer
    assert o["moe_router_bias_update_rate"] == 0.0  # the correction bias stays the checkpoint's
    assert (o["rope_type"], o["mscale"], o["mscale_all_dim"], o["rotary_scaling_factor"]) == ("rope", 1.0, 1.0, 1.0)
    assert ds.rope_theta == 10000.0
    yarn = AutoConfig.from_pretrained(TINY_DEEPSEEK)
    yarn.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                            "beta_slow": 1}
    o = fam.overrides(yarn, use_te=True)
    assert (o["rope_type"], o["rotary_scaling_factor"], o["original_max_position_embeddings"]) == ("yarn", 40.0, 4096)

    glm = AutoConfig.from_pretrained(TINY_GLM)
    assert getattr(glm, "partial_rotary_factor", None) is None  # transformers 5 keeps it in rope_parameters
    fam = family_for(glm)
    fam.prepare(glm)
    assert glm.partial_rotary_factor == 0.5 and fam.model_args(glm) == {"rotary_percent": 0.5}
    o = fam.overrides(glm, use_te=False)
    assert o["add_qkv_bias"] is True and o["moe_shared_expert_intermediate_size"] == 16
    assert o["moe_router_num_groups"] is None and o["moe_shared_expert_overlap"] is False
    glm.n_shared_experts, glm.attention_bias = 2, False
    o = fam.overrides(glm, use_te=False)
    assert o["moe_shared_expert_intermediate_size"] == 32 and o["add_qkv_bias"] is False  # mbridge: 16 and True


def test_local_spec_names():
    ds = family_for(AutoConfig.from_pretrained(TINY_DEEPSEEK))
    assert ds.global_name("decoder.layers.2.self_attention.q_layernorm.weight", True) == \
        "decoder.layers.2.self_attention.linear_q_up_proj.layer_norm_weight"
    assert ds.global_name("decoder.layers.2.self_attention.kv_layernorm.weight", True) == \
        "decoder.layers.2.self_attention.linear_kv_up_proj.layer_norm_weight"
    assert ds.global_name("decoder.layers.0.input_layernorm.weight", True) == "decoder.layers.0.input_layernorm.weight"
    assert Family().global_name("decoder.layers.0.input_layernorm.weight", True) == \
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
