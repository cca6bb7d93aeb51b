"""What the optimizer sees per step (issue 35 item 1d): the batch statistics and the behaviour-weight quantiles."""
import math

import torch

from mega_async.algo.loss import histogram_quantiles, log_weight_histogram
from mega_async.trainer.dispatch import batch_stats


def test_weight_quantiles_from_the_histogram_match_torch_quantile():
    g = torch.Generator().manual_seed(0)
    log_w = torch.randn(4, 500, generator=g) * 0.3
    mask = torch.rand(4, 500, generator=g) > 0.2
    log_w[0, 0] = math.inf  # never counted
    hist = log_weight_histogram(log_w[:2], mask[:2]) + log_weight_histogram(log_w[2:], mask[2:])  # summable
    finite = mask & torch.isfinite(log_w)
    assert int(hist.sum()) == int(finite.sum())
    q = histogram_quantiles(hist)
    xs = sorted(log_w[finite].tolist())
    for k, w in q.items():
        r = xs[math.ceil(k * len(xs)) - 1]  # the empirical quantile: the smallest x with ecdf(x) >= k
        assert abs(math.log(w) - r) <= 0.0051, (k, math.log(w), r)  # the centre of its 0.01-wide bin
    assert histogram_quantiles(torch.zeros_like(hist)) == {}


def test_weights_past_the_range_land_in_the_overflow_bins():
    hist = log_weight_histogram(torch.tensor([-9.0, 0.0, 9.0, 9.5]), torch.ones(4, dtype=torch.bool))
    assert hist[0] == 1 and hist[-1] == 2
    q = histogram_quantiles(hist, (0.1, 0.4, 0.99))
    assert q[0.1] == math.exp(-4.0) and q[0.4] == 1.0 and q[0.99] == math.exp(4.0)  # w = 1 is a bin's centre


def group(rewards, lengths, adv):
    L = max(lengths)
    mask = torch.zeros(len(lengths), L + 3, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, 3:3 + n] = 1
    return {"rewards": torch.tensor(rewards), "loss_mask": mask, "advantages": torch.tensor(adv)}


def test_batch_stats_by_hand():
    gs = [group([1.0, 0.0], [4, 2], [1.0, -1.0]), group([1.0, 1.0], [10, 30], [0.0, 0.0])]  # the 2nd: forced
    s = batch_stats(gs, torch.tensor([0.1, 0.1, 0.2, 0.6]))
    assert (s["groups"], s["sequences"], s["effective_groups"], s["effective_frac"]) == (2, 4, 1, 0.5)
    assert s["adv_abs_mean"] == 0.5 and s["adv_abs_max"] == 1.0 and s["adv_nonzero_frac"] == 0.5
    assert s["gen_len_max"] == 30 and s["gen_len_median"] == 4 and s["gen_len_max_over_median"] == 7.5
    assert s["gen_len_mean"] == 11.5
    assert math.isclose(s["gen_s_max_over_median"], 6.0, rel_tol=1e-6) and math.isclose(s["gen_s_median"], 0.1, rel_tol=1e-6)
    assert "gen_s_max" not in batch_stats(gs)
