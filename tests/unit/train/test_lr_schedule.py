"""train.lr_schedule: linear warmup, then cosine / linear decay to 10% of the peak at
max_steps, or constant; an unknown schedule is refused by the recipe."""

import pytest

from eagle_ray.recipes import load_recipe
from eagle_ray.train.loop import lr_lambda


@pytest.mark.parametrize("schedule,mid,end", [("cosine", 0.55, 0.1), ("linear", 0.55, 0.1),
                                              ("constant", 1.0, 1.0)])
def test_warmup_then_the_schedule(schedule, mid, end):
    f = lr_lambda(10, 110, schedule)
    assert [f(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(mid)
    assert f(110) == pytest.approx(end) and f(500) == pytest.approx(end)
    if schedule == "cosine":  # cosine stays above linear in the first half of the decay
        assert f(30) > lr_lambda(10, 110, "linear")(30)


def test_unknown_schedule_refused():
    with pytest.raises(ValueError, match="lr_schedule='step'; choose cosine, linear or constant"):
        load_recipe("tiny_cpu", ["train.lr_schedule=step"])
