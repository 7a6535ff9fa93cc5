"""The training plan's micro-batches (train/data.make_batches): every sample once, each
batch within the token budget (or a lone over-long sample), each as long as its sorted
window allows, the same for the same seed; and the store's lengths looked up by id."""

import random

import numpy as np
import pytest

from eagle_ray.train.data import make_batches


def _reference(lengths, budget, order):
    """The rule, one sample at a time: in length order, a sample joins the current batch
    unless the batch's padded size with it passes the budget."""
    out, cur = [], []
    for i in sorted(order, key=lambda i: lengths[i]):
        if cur and (len(cur) + 1) * lengths[i] > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + ([cur] if cur else [])


@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.parametrize("dist", ["uniform", "long_tail", "over_budget", "equal"])
def test_batches_cover_every_sample_once_within_budget_and_greedy(seed, dist):
    rng = random.Random(seed)
    n, budget = 3000, 512
    lengths = {"uniform": lambda: rng.randint(1, 120),
               "long_tail": lambda: int(rng.paretovariate(1.2) * 8),
               "over_budget": lambda: rng.choice([5, 40, 700]),
               "equal": lambda: 16}[dist]
    lengths = [lengths() for _ in range(n)]
    batches = make_batches(lengths, budget, seed)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(n))
    for b in batches:
        assert all(type(i) is int for i in b)
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget
    assert make_batches(lengths, budget, seed) == batches
    assert make_batches(lengths, budget, seed + 1) != batches
    # with one window over everything the batches are exactly the one-at-a-time rule's
    whole = make_batches(lengths, 10 ** 9, seed)
    assert len(whole) == 1
    small_n = [lengths[i] for i in range(200)]
    got = sorted(map(sorted, make_batches(small_n, budget * 1000, seed)))
    want = sorted(map(sorted, _reference(small_n, budget * 1000, range(200))))
    assert got == want


def test_within_a_window_the_batches_follow_the_one_at_a_time_rule():
    rng = random.Random(3)
    lengths = [rng.randint(1, 300) for _ in range(500)]
    budget = 40_000  # window = 64 * budget // mean > 500: one window, the whole set
    def profile(batches):  # batch lengths, sorted: equal samples may trade places
        return sorted(sorted(lengths[i] for i in b) for b in batches)

    assert profile(make_batches(lengths, budget, 0)) == profile(_reference(lengths, budget, range(500)))
    got = sorted(map(sorted, make_batches(lengths, 2000, 0)))
    assert all(len(b) * max(lengths[i] for i in b) <= 2000 for b in got)
    assert np.isclose(sum(map(len, got)), 500)


def test_empty_and_single():
    assert make_batches([], 100, 0) == []
    assert make_batches([500], 100, 0) == [[0]]
