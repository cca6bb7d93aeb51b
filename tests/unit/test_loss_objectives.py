"""Off-policy objectives and numerics of the decoupled PPO loss, against hand-computed vectors."""
import math

import pytest
import torch

from mega_async.algo.loss import approximate_proximal_logprobs, behaviour_weights, decoupled_ppo_loss

E = math.e


def t(*x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


# the worked example of test_algo: w = [e^.1, 1, e^1.5], r = [e^.1, 1, e^-.5], A = [1, -1, 1]; 4th token masked
LP, PROX, BEHAV, ADV, MASK = (t(-1, -0.5, -2, -0.2), t(-1.1, -0.5, -1.5, -0.2), t(-1.2, -0.5, -3, -0.3),
                              t(1, -1, 1, 0.5), torch.tensor([1, 1, 1, 0]))
T0, T1, T2 = -E ** 0.2, 1.0, -E ** 1.5 * E ** -0.5  # w * pg per token: -1.2214, 1, -e


def loss_of(**kw):
    return decoupled_ppo_loss(LP, PROX, BEHAV, ADV, MASK, **kw)


def test_icepop_masks_both_sides():
    loss, st = loss_of(imp_weight_mode="icepop", imp_weight_bounds=[0.5, 2.0])  # w = e^1.5 = 4.48 too high
    assert loss.item() == pytest.approx((T0 + T1) / 3, abs=1e-9)
    assert st["imp_weight_capped_frac"].item() == pytest.approx(1 / 3)
    loss, _ = loss_of(imp_weight_mode="icepop", imp_weight_bounds=[1.2, 5.0])  # w = 1.105 and 1 too low
    assert loss.item() == pytest.approx(T2 / 3, abs=1e-9)
    loss, _ = loss_of(imp_weight_mode="icepop", imp_weight_bounds=[0.5, 5.0])  # the default-like window keeps all
    assert loss.item() == pytest.approx((T0 + T1 + T2) / 3, abs=1e-9)


def test_tis_truncates_at_cap_without_masking():
    loss, st = loss_of(imp_weight_mode="tis", behav_imp_weight_cap=2.0)
    assert loss.item() == pytest.approx((T0 + T1 + 2.0 * -E ** -0.5) / 3, abs=1e-9)
    assert st["imp_weight_capped_frac"] == 0
    with pytest.raises(ValueError, match="needs a cap"):
        loss_of(imp_weight_mode="tis")


def test_sequence_mask_drops_whole_sequences_by_geometric_mean():
    # row 0: log w = [0.1, 0] -> geo-mean e^0.05; row 1: log w = [1.5, 0.5] -> e^1.0 = 2.72 > 2
    lp = torch.tensor([[-1.0, -0.5], [-2.0, -1.0]], dtype=torch.float64)
    prox = torch.tensor([[-1.1, -0.5], [-1.5, -1.0]], dtype=torch.float64)
    behav = torch.tensor([[-1.2, -0.5], [-3.0, -1.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0], [1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(2, 2)
    loss, st = decoupled_ppo_loss(lp, prox, behav, adv, mask, imp_weight_mode="seq_mask", imp_weight_bounds=[0.5, 2])
    assert loss.item() == pytest.approx((T0 + T1) / 4, abs=1e-9)
    assert st["imp_weight_capped_frac"].item() == 0.5
    # the same two sequences packed into one stream with seq_ids
    flat, ids = lambda x: x.reshape(-1), torch.tensor([0, 0, 1, 1])  # noqa: E731
    packed, _ = decoupled_ppo_loss(flat(lp), flat(prox), flat(behav), flat(adv), flat(mask), seq_ids=ids,
                                   imp_weight_mode="seq_mask", imp_weight_bounds=[0.5, 2])
    assert packed.item() == pytest.approx(loss.item(), abs=1e-12)
    # a wider window keeps row 1; kept tokens then carry their own token weights
    wide, _ = decoupled_ppo_loss(lp, prox, behav, adv, mask, imp_weight_mode="seq_mask", imp_weight_bounds=[0.5, 3])
    row1 = -E ** 1.5 * E ** -0.5 + -E ** 0.5 * 1.0
    assert wide.item() == pytest.approx((T0 + T1 + row1) / 4, abs=1e-9)


def test_gspo_sequence_ratio_value_and_gradient():
    lp = torch.tensor([-1.0, -0.5, -2.0], dtype=torch.float64, requires_grad=True)
    prox = t(-1.1, -0.5, -1.5)
    s = math.exp((0.1 + 0.0 - 0.5) / 3)  # 0.8752
    loss, _ = decoupled_ppo_loss(lp, prox, prox, t(1, 1, 1), torch.ones(3), objective="gspo")
    assert loss.item() == pytest.approx(-s, abs=1e-12)
    loss.backward()
    assert torch.allclose(lp.grad, torch.full((3,), -s / 3, dtype=torch.float64))  # d(-s)/dlp_t = -s/3
    clipped, st = decoupled_ppo_loss(lp.detach(), prox, prox, t(-1, -1, -1), torch.ones(3), objective="gspo",
                                     eps_clip=0.1)
    assert clipped.item() == pytest.approx(0.9, abs=1e-12) and st["clip_frac"] == 1.0  # max(s, 0.9) for A = -1
    # two packed sequences: each gets its own ratio; the second is s2 = e^0.2 = 1.22, clipped to 1.2 for A = 1
    lp2, prox2 = t(-1, -0.5, -2, -0.3, -0.3), t(-1.1, -0.5, -1.5, -0.5, -0.5)
    two, _ = decoupled_ppo_loss(lp2, prox2, prox2, t(1, 1, 1, 1, 1), torch.ones(5), objective="gspo",
                                seq_ids=torch.tensor([0, 0, 0, 1, 1]))
    assert two.item() == pytest.approx((3 * -s + 2 * -1.2) / 5, abs=1e-12)
    with pytest.raises(ValueError, match="objective"):
        decoupled_ppo_loss(lp2, prox2, prox2, lp2, torch.ones(5), objective="seq")


@pytest.mark.parametrize("mode,kw", [("cap_mask", {"behav_imp_weight_cap": 5.0}),
                                     ("icepop", {"imp_weight_bounds": [0.5, 5.0]}),
                                     ("seq_mask", {"imp_weight_bounds": [0.5, 5.0]}),
                                     ("tis", {"behav_imp_weight_cap": 5.0})])
@pytest.mark.parametrize("objective", ["token", "gspo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overflowing_and_non_finite_weights_never_poison_the_gradient(mode, kw, objective, dtype):
    # token 1 is trained; token 2 has prox - behav = 100 (exp overflows fp32 and bf16) but is masked; token 3 holds
    # NaN and -inf on a masked position; token 4 is a masked prompt token with garbage logprobs
    lp = torch.tensor([-1.0, -0.5, -2.0, -3.0], dtype=dtype, requires_grad=True)
    prox = torch.tensor([-1.1, -0.4, -float("inf"), 50.0], dtype=dtype)
    behav = torch.tensor([-1.2, -100.4, float("nan"), -60.0], dtype=dtype)
    adv = torch.tensor([1.0, 1.0, float("nan"), 2.0], dtype=dtype)
    mask = torch.tensor([1, 0, 0, 0])
    loss, st = decoupled_ppo_loss(lp, prox, behav, adv, mask, objective=objective, imp_weight_mode=mode, **kw)
    loss.backward()
    d = (prox[0] - behav[0]).item()  # 0.1 up to the dtype's rounding
    expect = -math.exp(d) * math.exp((lp[0] - prox[0]).item())  # w = e^0.1, r = e^0.1 inside the clip
    rel = 1e-6 if dtype == torch.float32 else 2e-2
    assert loss.float().item() == pytest.approx(expect, rel=rel)
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0].float().item() == pytest.approx(expect, rel=rel) and (lp.grad[1:] == 0).all()
    assert all(torch.isfinite(v).all() for v in st.values())


def test_overflowing_weight_on_a_capped_trained_token_is_masked_with_finite_gradient():
    lp = torch.tensor([-1.0, -0.5], requires_grad=True)
    prox, behav = torch.tensor([-1.1, -0.4]), torch.tensor([-1.2, -100.4])  # w2 = e^100 = inf in fp32
    loss, st = decoupled_ppo_loss(lp, prox, behav, torch.tensor([1.0, 1.0]), torch.ones(2), behav_imp_weight_cap=5)
    loss.backward()
    assert loss.item() == pytest.approx(-math.exp(0.2) / 2, rel=1e-6)  # token 2 masked, kept in the denominator
    assert torch.isfinite(lp.grad).all() and lp.grad[1] == 0
    assert st["imp_weight_capped_frac"] == 0.5 and st["behav_imp_weight_max"].item() == pytest.approx(math.exp(0.1))
    # TIS truncates the infinite weight to the cap instead
    lp.grad = None
    tis, _ = decoupled_ppo_loss(lp, prox, behav, torch.tensor([1.0, 1.0]), torch.ones(2), behav_imp_weight_cap=5,
                                imp_weight_mode="tis")
    tis.backward()
    # token 2: r = e^0.1 -> inside the clip, w = 5
    assert tis.item() == pytest.approx((-math.exp(0.2) - 5 * math.exp(-0.1)) / 2, rel=1e-6)
    assert torch.isfinite(lp.grad).all()


def test_extreme_policy_ratio_on_a_kept_token_has_finite_gradient():
    lp = torch.tensor([0.0], requires_grad=True)
    prox = torch.tensor([-95.0])  # r = e^95 overflows fp32; clipped at 1 + eps for A > 0
    loss, _ = decoupled_ppo_loss(lp, prox, prox, torch.tensor([1.0]), torch.ones(1))
    loss.backward()
    assert loss.item() == pytest.approx(-1.2) and torch.isfinite(lp.grad).all()


def test_behaviour_weights_direct():
    w, keep = behaviour_weights(torch.tensor([0.0, 2.0, -2.0, float("inf")]), torch.ones(4, dtype=torch.bool),
                                "icepop", bounds=[0.5, 5.0])
    assert keep.tolist() == [True, False, False, False] and w.tolist() == [1.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="bounds"):
        behaviour_weights(torch.zeros(1), torch.ones(1, dtype=torch.bool), "icepop")
    with pytest.raises(ValueError, match="imp_weight_mode"):
        behaviour_weights(torch.zeros(1), torch.ones(1, dtype=torch.bool), "kpop")


def test_linear_proximal_approximation_never_underflows_to_minus_inf():
    behav = torch.tensor([-120.0, -130.0, -1.0])  # exp() of these is 0 in fp32
    theta = torch.tensor([-110.0, -130.0, -1.5])
    out = approximate_proximal_logprobs(behav, theta, torch.tensor([0, 0, -1]), 2, method="linear")  # alpha 0.5
    assert torch.isfinite(out).all()
    assert out[0].item() == pytest.approx(-110 + math.log(0.5 + 0.5 * math.exp(-10)), abs=1e-4)
    assert out[1].item() == pytest.approx(-130.0, abs=1e-4)
    assert out[2].item() == -1.0  # prompt token: behaviour
    # alpha = 0 (token of the current version) reproduces the behaviour logprobs exactly
    ends = approximate_proximal_logprobs(behav, theta, torch.tensor([2, 2, 2]), 2, method="linear")
    assert torch.equal(ends, behav)
