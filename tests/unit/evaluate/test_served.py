"""The served distribution, the offline expectation's step rates and the distribution test."""

import random

import pytest
import torch

from eagle_ray.evaluate.served import (distribution_lines, distribution_test, distribution_tests,
                                       served_probs, served_step_rates)


def test_served_probs_temperature_top_p_top_k_min_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -5.0]])
    p = logits.softmax(-1)[0]  # 0.665 0.245 0.090 0.0006
    full = served_probs(logits, {"temperature": 1.0, "top_p": 1.0})
    assert torch.allclose(full[0], p)
    # top_p 0.8: ascending cumulative 0.0006, 0.091, 0.335, 1: tail <= 0.2 dropped (vLLM's rule)
    nucleus = served_probs(logits, {"temperature": 1.0, "top_p": 0.8})[0]
    assert nucleus[2] == 0 and nucleus[3] == 0 and torch.isclose(nucleus[:2].sum(), torch.tensor(1.0))
    assert served_probs(logits, {"temperature": 1.0, "top_p": 0.01})[0].tolist() == [1.0, 0, 0, 0]
    assert served_probs(logits, {"temperature": 1.0, "top_k": 1})[0].tolist() == [1.0, 0, 0, 0]
    hot = served_probs(logits, {"temperature": 2.0})[0]
    assert torch.allclose(hot, (logits / 2).softmax(-1)[0])
    assert served_probs(logits, {"temperature": 1.0, "min_p": 0.2})[0][2] == 0
    with pytest.raises(ValueError, match="temperature > 0"):
        served_probs(logits, {"temperature": 0.0})


def test_step_rates_greedy_is_p_of_argmax_and_probabilistic_is_overlap():
    torch.manual_seed(0)
    V, H, N, n = 12, 6, 8, 5
    head = torch.randn(V, H)
    final = torch.randn(n, H)
    draft_ids = torch.tensor([0, 1, 2, 3, 5, 7, 9, 11])
    dl = torch.randn(n, N)
    sampling = {"temperature": 0.7, "top_p": 0.9}
    g, pr = served_step_rates(final, dl, head, draft_ids, sampling)
    p = served_probs(final @ head.T, sampling)
    assert torch.allclose(g, p[torch.arange(n), draft_ids[dl.argmax(-1)]])
    q = torch.zeros(n, V)
    q[:, draft_ids] = (dl / 0.7).softmax(-1)
    assert torch.allclose(pr, torch.minimum(p, q).sum(-1), atol=1e-6)
    # A drafter equal to the target (full vocab, no top-p) is accepted with probability 1.
    same = {"temperature": 1.0}
    _, one = served_step_rates(final, final @ head.T, head, torch.arange(V), same)
    assert torch.allclose(one, torch.ones(n), atol=1e-5)


def _samples(prompts, seeds, peak, rng):
    out = []
    for _ in range(seeds):
        row = []
        for i in range(prompts):
            w = [peak if j == i % 5 else 1.0 for j in range(10)]
            row.append(rng.choices(range(10), weights=w, k=40))
        out.append(row)
    return out


def test_distribution_test_size_and_power():
    rng = random.Random(0)
    alike = [distribution_test(_samples(24, 2, 4.0, rng), _samples(24, 2, 4.0, rng), permutations=500)
             for _ in range(20)]
    assert sum(r["p_value"] < 0.05 for r in alike) <= 4  # ~5% false alarms expected, 20 trials
    other = distribution_test(_samples(24, 2, 4.0, rng), _samples(24, 2, 8.0, rng), permutations=500)
    assert other["p_value"] < 0.01
    res = distribution_tests(_samples(24, 2, 4.0, rng), {"a": _samples(24, 2, 8.0, rng)}, permutations=500)
    assert not res["passed"] and "FAILED" in distribution_lines(res)[0]
    with pytest.raises(ValueError, match="same prompts and seeds"):
        distribution_test([[[1]]], [[[1]], [[2]]])
