import torch

from mega_async.server.sampling import sample


def freqs(logits, n, **kw):
    g = torch.Generator().manual_seed(0)
    B = logits.shape[0]
    kw = {"temperature": [1.0] * B, "top_k": [-1] * B, "top_p": [1.0] * B, **kw}
    counts = torch.zeros_like(logits)
    for _ in range(n):
        t, _ = sample(logits, generator=g, **kw)
        counts[torch.arange(B), t] += 1
    return counts / n


def test_sampling_matches_distribution_and_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    f = freqs(logits, 20000, temperature=[0.7])
    p = torch.softmax(logits / 0.7, -1)
    assert (f - p).abs().max() < 0.015
    t, lp = sample(logits, [0.7], [-1], [1.0], torch.Generator().manual_seed(1))
    assert torch.allclose(lp, torch.log_softmax(logits / 0.7, -1)[0, t])


def test_greedy_top_k_top_p_rows_in_one_batch():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 3)
    f = freqs(logits, 4000, temperature=[0.0, 1.0, 1.0], top_k=[-1, 2, -1], top_p=[1.0, 1.0, 0.7])
    assert f[0].tolist() == [0, 1, 0, 0]  # greedy
    assert f[1, 0] == 0 and f[1, 2] == 0  # top-k 2 keeps tokens 1 and 3
    p = torch.softmax(logits[1], -1)
    assert abs(f[1, 1] - p[1] / (p[1] + p[3])) < 0.03
    # top-p 0.7: token 1 (p=.64) alone is below 0.7, so token 3 (p=.24) is kept too; the rest dropped
    assert f[2, 0] == 0 and f[2, 2] == 0 and f[2, 3] > 0
    _, lp = sample(logits, [1.0] * 3, [2] * 3, [0.5] * 3, torch.Generator().manual_seed(0))
    full = torch.log_softmax(logits, -1)  # logprobs are before truncation
    assert set(lp.tolist()) <= set(full[0].tolist())
