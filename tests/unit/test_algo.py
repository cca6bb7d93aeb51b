import math

import pytest
import torch

from mega_async.algo.advantages import grpo_advantages, token_advantages
from mega_async.algo.loss import approximate_proximal_logprobs, decoupled_ppo_loss, kl_penalty


def test_worked_example_from_the_docs():
    t = lambda *x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    loss, st = decoupled_ppo_loss(t(-1, -0.5, -2, -0.2), t(-1.1, -0.5, -1.5, -0.2), t(-1.2, -0.5, -3, -0.3),
                                  t(1, -1, 1, 0.5), torch.tensor([1, 1, 1, 0]), eps_clip=0.2, behav_imp_weight_cap=5)
    assert loss.item() == pytest.approx(-0.97989, abs=1e-5)
    assert st["n_tokens"] == 3 and st["imp_weight_capped_frac"] == 0
    # a tighter cap masks the third token (w = e^1.5 = 4.48) but keeps it in the denominator
    loss2, st2 = decoupled_ppo_loss(t(-1, -0.5, -2, -0.2), t(-1.1, -0.5, -1.5, -0.2), t(-1.2, -0.5, -3, -0.3),
                                    t(1, -1, 1, 0.5), torch.tensor([1, 1, 1, 0]), behav_imp_weight_cap=4)
    assert loss2.item() == pytest.approx((-1.2214 + 1.0) / 3, abs=1e-4)
    assert st2["imp_weight_capped_frac"].item() == pytest.approx(1 / 3)


def test_sync_ppo_special_case_and_gradient():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    old = torch.tensor([-1.0, -2.0])
    loss, _ = decoupled_ppo_loss(lp, old, old, torch.tensor([1.0, -1.0]), torch.ones(2))
    loss.backward()
    assert loss.item() == pytest.approx(0.0) and torch.allclose(lp.grad, torch.tensor([-0.5, 0.5]))


def test_clip_high_dual_clip_and_denominator():
    adv = torch.tensor([1.0, -1.0])
    lp, prox = torch.tensor([0.0, 0.0]), torch.tensor([-0.5, -1.5])  # ratios e^0.5, e^1.5
    base, st = decoupled_ppo_loss(lp, prox, prox, adv, torch.ones(2), eps_clip=0.2)
    assert st["clip_frac"] == 0.5
    high, _ = decoupled_ppo_loss(lp, prox, prox, adv, torch.ones(2), eps_clip=0.2, eps_clip_high=0.28)
    assert high < base  # a higher ceiling lets the positive-advantage token gain more
    dual, st = decoupled_ppo_loss(lp, prox, prox, adv, torch.ones(2), dual_clip=3.0)
    assert dual.item() == pytest.approx((-1.2 + 3.0) / 2) and st["dual_clip_frac"] == 0.5
    summed, _ = decoupled_ppo_loss(lp, prox, prox, adv, torch.ones(2), denominator=10.0)
    assert summed.item() == pytest.approx(base.item() * 2 / 10)
    with pytest.raises(ValueError):
        decoupled_ppo_loss(lp, prox, prox, adv, torch.ones(2), dual_clip=0.5)


def test_proximal_approximation_example():
    behav, theta = torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.5, -2.5, -3.5])
    out = approximate_proximal_logprobs(behav, theta, torch.tensor([0, 0, 0]), 2)
    assert torch.allclose(out, torch.tensor([-1.25, -2.25, -3.25]))
    # same version -> behaviour; one version behind -> alpha 0 too; prompt tokens -> behaviour
    same = approximate_proximal_logprobs(behav, theta, torch.tensor([2, 1, -1]), 2)
    assert torch.allclose(same, behav)
    lin = approximate_proximal_logprobs(behav, theta, torch.tensor([0, 0, 0]), 2, method="linear")
    assert torch.allclose(lin.exp(), 0.5 * behav.exp() + 0.5 * theta.exp())
    with pytest.raises(ValueError):
        approximate_proximal_logprobs(behav, theta, torch.zeros(3), 1, method="cubic")


def test_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    g = grpo_advantages(r, 3)
    assert torch.allclose(g[:3], torch.tensor([2.0, -1.0, -1.0]) / math.sqrt(2), atol=1e-4)
    assert torch.allclose(grpo_advantages(r, 3, "drgrpo")[:3], torch.tensor([2 / 3, -1 / 3, -1 / 3]))
    assert torch.allclose(grpo_advantages(r, 3, "rloo")[:3], torch.tensor([1.0, -0.5, -0.5]))
    b = grpo_advantages(r, 3, "batch")
    assert abs(b.mean()) < 1e-6
    assert torch.allclose(grpo_advantages(r, 3, "none", reward_scale=10, reward_bias=-5), r * 10 - 5)
    assert token_advantages(torch.tensor([2.0]), torch.tensor([[0, 1, 1]])).tolist() == [[0.0, 2.0, 2.0]]
    with pytest.raises(ValueError, match="groups of 4"):
        grpo_advantages(r, 4)


def test_kl_estimators():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
