"""run.json's draft_vocab_coverage: the share of the training split's loss tokens the run's
draft vocabulary holds (the bound on every position's acceptance), from the run's final d2t."""

import torch

from eagle_ray.model.vocab import build_draft_vocab
from eagle_ray.train.run import _coverage


def test_coverage_counts_the_loss_tokens_the_draft_vocabulary_holds():
    counts = torch.tensor([10, 0, 5, 4, 1])
    d2t, _ = build_draft_vocab(counts, 2)  # ids 0 and 2
    out = _coverage({"d2t": d2t.tolist()}, counts)
    assert out["draft_vocab_coverage"] == 15 / 20
    assert _coverage({"d2t": build_draft_vocab(counts, 5)[0].tolist()}, counts)["draft_vocab_coverage"] == 1.0


def test_coverage_follows_a_published_d2t_not_the_data_top_n():
    """A run that keeps a published drafter's vocabulary (init_vocab keep) is bounded by that
    vocabulary, whatever the data's own top-N would have been."""
    counts = torch.tensor([10, 0, 5, 4, 1])
    published = torch.tensor([1, 4]) - torch.arange(2)  # draft ids 0,1 -> target ids 1,4
    assert _coverage({"d2t": published.tolist()}, counts)["draft_vocab_coverage"] == 1 / 20
