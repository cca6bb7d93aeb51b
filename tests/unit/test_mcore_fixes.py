"""mega_async/trainer/mcore_fixes.py: Megatron-LM#5916's gradient-norm duplicate filter on 0.16.1 (the expert
marking itself runs in tests/dist/test_layout_parity.py, where removing it fails the TP2 x ETP1 layout)."""
from types import SimpleNamespace

import torch


def test_an_expert_weight_not_split_over_tp_counts_on_every_tp_rank_of_expert_tp_rank_0(monkeypatch):
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import layers

    from mega_async.trainer.mcore_fixes import _expert_aware

    monkeypatch.setattr(layers, "get_tensor_model_parallel_rank", lambda: 1)
    fixed = _expert_aware(layers.param_is_not_tensor_parallel_duplicate)
    dense, expert, split = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1)), \
        torch.nn.Parameter(torch.zeros(1))
    expert.allreduce = False  # Transformer Engine's grouped GEMM at ETP 1: not marked tensor-parallel
    split.tensor_model_parallel = True
    for etp_rank, want in ((0, True), (1, False)):
        monkeypatch.setattr(mpu, "get_expert_tensor_parallel_rank", lambda r=etp_rank: r)
        assert fixed(expert) is want  # 0.16.1 asked the TP rank (1 here) and dropped it on every expert-TP rank
    assert fixed(dense) is False and fixed(split) is True  # dense weights as before: TP rank 0 only, split ones always
    assert fixed(dense, tp_group=SimpleNamespace(rank=lambda: 0)) is True
