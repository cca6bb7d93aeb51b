"""Multi-token-prediction layers: the HF <-> Megatron names, the MTP targets on a packed stream, which servers the
weight sync sends them to (pure; the models run in tests/dist/test_mtp.py)."""
import torch

from mega_async.bridge import mtp
from mega_async.api.sglang_releases import Release, mtp_plan, serves_draft
from mega_async.trainer.mtp import mtp_targets


def test_names_both_ways():
    assert mtp.global_name("mtp.layers.0.transformer_layer.mlp.router.weight", 61) == "decoder.layers.61.mlp.router.weight"
    assert mtp.global_name("mtp.layers.0.eh_proj.weight", 61) == "mtp.layers.0.eh_proj.weight"
    assert mtp.global_name("decoder.layers.3.mlp.router.weight", 61) == "decoder.layers.3.mlp.router.weight"
    assert mtp.hf_names("mtp.layers.0.final_layernorm.weight", 92) == ["model.layers.92.shared_head.norm.weight"]
    assert mtp.hf_names("mtp.layers.1.enorm.weight", 4) == ["model.layers.5.enorm.weight"]
    assert mtp.hf_names("decoder.final_layernorm.weight", 4) is None
    # the shared embedding and head also go out as the MTP layers' copies, where the stage holds them
    assert mtp.export_names("model.embed_tokens.weight", 4, 1, True, True) == [
        "model.embed_tokens.weight", "model.layers.4.embed_tokens.weight"]
    assert mtp.export_names("model.embed_tokens.weight", 4, 1, False, True) == ["model.layers.4.embed_tokens.weight"]
    assert mtp.export_names("lm_head.weight", 4, 1, True, True) == ["lm_head.weight",
                                                                     "model.layers.4.shared_head.head.weight"]
    assert mtp.export_names("lm_head.weight", 4, 0, True, False) == ["lm_head.weight"]
    assert mtp.is_mtp_hf_name("model.layers.4.eh_proj.weight", 4) and not mtp.is_mtp_hf_name("model.layers.3.x", 4)
    assert mtp.shared_copy_of("model.layers.4.shared_head.head.weight", 4) == "lm_head.weight"


def test_targets_stay_inside_each_sequence():
    labels = torch.tensor([11, 12, 13, 0, 21, 22, 0, 0])
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 0, 0])
    cu = torch.tensor([0, 4, 8])
    lab, m = mtp_targets(labels, mask, cu)
    assert lab.tolist() == [12, 13, 0, 0, 22, 0, 0, 0]
    assert m.tolist() == [1, 1, 0, 0, 1, 0, 0, 0]  # the token after the next one, if trained and in the sequence
    lab2, m2 = mtp_targets(labels, mask, cu, depth=2)
    assert lab2.tolist() == [13, 0, 0, 0, 0, 0, 0, 0] and m2.tolist() == [1, 0, 0, 0, 0, 0, 0, 0]


def test_which_servers_get_the_mtp_layers():
    new, old = "0.5.23", "0.5.20"
    draft = Release.of(new, draft=True)
    plain = Release.of(new)
    embedded = Release.of(new, embedded=True)
    assert serves_draft({"speculative_algorithm": "EAGLE"}) and serves_draft({"speculative_algorithm": "NEXTN"})
    assert not serves_draft({"speculative_algorithm": None}) and not serves_draft({})
    assert mtp_plan([("a", draft), ("b", draft)]) == (True, None)
    assert mtp_plan([("a", plain), ("b", None)]) == (False, None)  # target only
    assert mtp_plan([("a", embedded)]) == (True, None)  # the embedded server keeps every checkpoint weight
    send, why = mtp_plan([("a", draft), ("b", plain)])
    assert not send and "a serve an MTP draft and b do not" in why and "\n" not in why
    send, why = mtp_plan([("a", Release.of(old, draft=True))])
    assert not send and "a (SGLang 0.5.20)" in why and "trainer.weight_sync=disk" in why
    assert mtp_plan([("a", Release.of(old))]) == (False, None)


def test_mtp_settings_for_a_model_without_mtp_layers_are_refused_not_ignored(tmp_path):
    import pytest

    from mega_async.api.config import ConfigError, TrainerConfig

    from mega_async.api.config_load import load_config
    from mega_async.run.tasks import check_inputs

    TrainerConfig().check_mtp(0)  # the defaults say nothing
    TrainerConfig(mtp="freeze").check_mtp(1)
    with pytest.raises(ConfigError, match=r"^ConfigError: trainer.mtp=freeze: this model has no multi-token-prediction layers"):
        TrainerConfig(mtp="freeze").check_mtp(0)
    cfg = load_config("configs/tiny_cpu.yaml", ["trainer.mtp_loss_scaling_factor=0.5"])  # Qwen3-MoE: none
    with pytest.raises(ConfigError, match="trainer.mtp_loss_scaling_factor=0.5: this model has no"):
        check_inputs(cfg)
