import pytest
from transformers import AutoConfig

from mega_async.bridge.model_cards import TINY_DENSE, TINY_MOE
from mega_async.trainer.parallel import AllocationError, ParallelStrategy, parse_allocation, validate_for_model


def test_plain_and_named():
    a = parse_allocation("sglang:d4t2+megatron:d2p2t2e4")
    assert a.inference.backend == "sglang" and a.inference.strategy.world_size == 8
    s = a.train
    assert (s.dp, s.pp, s.tp, s.ep, s.etp, s.world_size) == (2, 2, 2, 4, 1, 8)
    assert a.total_gpus == 16
    b = parse_allocation("sglang[rollout]:d4+megatron[actor]:d4p2")
    assert b.inference.name == "rollout" and b.trainer.name == "actor" and b.train.world_size == 8
    assert parse_allocation("megatron:t2").train.etp == 2  # experts follow TP when EP = 1
    assert parse_allocation("megatron:d2p2v2").train.vpp == 2


def test_hybrid():
    s = parse_allocation("megatron:(attn:d2p2t2c2|ffn:d2p2t1e4)").train
    assert (s.dp, s.pp, s.tp, s.cp, s.ep, s.etp, s.world_size, s.edp) == (2, 2, 2, 2, 4, 1, 16, 2)


@pytest.mark.parametrize("bad, needle", [
    ("", "empty"),
    ("megatron:d2x3", "unknown dimension 'x'"),
    ("megatron:d2d2", "given twice"),
    ("megatron:d0", "must be >= 1"),
    ("pytorch:d2", "unknown backend 'pytorch'"),
    ("megatron:(attn:d2p2|ffn:d2p1e2)", "pipeline sizes differ: attn p=2, ffn p=1"),
    ("megatron:(attn:d4|ffn:d1e2)", "world sizes differ: attn 4 GPUs, ffn 2 GPUs"),
    ("megatron:(attn:d2", "unbalanced"),
    ("sglang:(attn:d2|ffn:e2)", "trainer (megatron) only"),
    ("megatron:d1e4", "ep=4 x etp=1 = 4 does not divide dp x tp x cp = 1"),
    ("megatron:d2+megatron:d2", "two trainer parts"),
    ("d2t2", "is not <backend>"),
])
def test_invalid_strings(bad, needle):
    with pytest.raises(AllocationError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        parse_allocation(bad)


def test_validate_against_model_names_both_numbers():
    moe, dense = AutoConfig.from_pretrained(TINY_MOE), AutoConfig.from_pretrained(TINY_DENSE)
    validate_for_model(parse_allocation("megatron:d2t2e2").train, moe)
    with pytest.raises(AllocationError, match="tp=3 does not divide num_attention_heads=4"):
        validate_for_model(ParallelStrategy(tp=3), moe)
    with pytest.raises(AllocationError, match="ep=3 does not divide num_experts=8"):
        validate_for_model(ParallelStrategy(dp=3, ep=3), moe)
    with pytest.raises(AllocationError, match=r"pp x vpp = 2 x 4 = 8 does not divide num_hidden_layers=4"):
        validate_for_model(ParallelStrategy(pp=2, vpp=4), dense)
    with pytest.raises(AllocationError, match="has no experts"):
        validate_for_model(ParallelStrategy(dp=2, ep=2), dense)


def test_expert_tp_above_attention_tp_is_a_layout_the_trainer_takes():
    """ETP > TP trains exactly since mcore_fixes' expert marking (tests/dist/test_layout_parity.py: (2,1,4),
    (1,2,2)); Megatron-Core 0.16.1 alone reduced those experts over the wrong group, which was refused here."""
    from mega_async.api.allocation import parse_allocation

    s = parse_allocation("megatron:(attn:d2t2|ffn:t4)").train
    assert (s.tp, s.ep, s.etp, s.edp, s.world_size) == (2, 1, 4, 1, 4)
    validate_for_model(s, AutoConfig.from_pretrained(TINY_MOE))


def test_duplicate_role_names_are_rejected():
    from mega_async.api.allocation import AllocationError, parse_allocation

    with pytest.raises(AllocationError, match=r"role name \[actor\].*both sglang and megatron"):
        parse_allocation("sglang[actor]:d2+megatron[actor]:d4")
    a = parse_allocation("sglang[rollout]:d2+megatron[actor]:d4")
    assert (a.inference.name, a.trainer.name) == ("rollout", "actor")
