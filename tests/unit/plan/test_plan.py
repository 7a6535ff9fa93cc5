import numpy as np
import pytest

from eagle_ray.recipes import load_recipe
from eagle_ray.plan.budget import (BudgetError, check_budget, drafter_trainable_params,
                                   hidden_bytes_per_token, make_plan)

GB = 10**9


def test_bytes_per_token_three_recipes():
    assert hidden_bytes_per_token(load_recipe("kimi_k25_8gpu").target, "bf16") == 4 * 7168 * 2 == 57_344
    assert hidden_bytes_per_token(load_recipe("llama31_8b_8gpu").target, "bf16") == 4 * 4096 * 2
    assert hidden_bytes_per_token(load_recipe("tiny_cpu").target, "bf16") == 4 * 128 * 2
    # fp8: one byte per element + one fp32 scale per token per captured layer.
    assert hidden_bytes_per_token(load_recipe("kimi_k25_8gpu").target, "fp8_e4m3") == 4 * 7168 + 4 * 4
    assert hidden_bytes_per_token(load_recipe("tiny_cpu").target, "fp32") == 4 * 128 * 4


def test_plan_totals_and_fit():
    r = load_recipe("kimi_k25_8gpu")
    p = make_plan(r, num_samples=100_000, avg_tokens=2_000, free=20 * 10**12)
    assert p.total_tokens == 200_000_000
    assert p.total_bytes == 200_000_000 * (57_344 + 5)
    assert p.fits and p.shortfall_bytes == 0 and p.alternatives == []
    small = make_plan(r, num_samples=100_000, avg_tokens=2_000, free=1000 * GB)
    assert not small.fits
    assert small.shortfall_bytes == small.total_bytes - int(1000 * GB * 0.95)
    kinds = {a["kind"]: a for a in small.alternatives}
    fewer = kinds["fewer_samples"]
    assert fewer["bytes"] <= small.usable_bytes
    assert (fewer["num_samples"] + 1) * 2000 * small.store_bytes_per_token > small.usable_bytes
    assert kinds["shorter_max_seq_len"]["bytes"] <= small.usable_bytes
    assert kinds["storage.dtype=fp8_e4m3"]["fits"] is False  # 200M tokens x 28.7 KB > 950 GB


def test_shorter_length_uses_the_real_length_distribution():
    r = load_recipe("tiny_cpu")  # 1029 bytes/token stored
    lengths = np.array([10] * 90 + [1000] * 10)
    per = 4 * 128 * 2 + 5
    free = int(3000 * per / 0.95) + 1  # room for 3000 tokens
    p = make_plan(r, num_samples=100, avg_tokens=float(lengths.mean()), lengths=lengths, free=free)
    alt = {a["kind"]: a for a in p.alternatives}["shorter_max_seq_len"]
    # 90*10 + 10*L <= 3000  ->  L = 210
    assert alt["max_seq_len"] == 210 and alt["bytes"] == (900 + 2100) * per


def test_check_budget_refuses_with_shortfall(tmp_path):
    r = load_recipe("kimi_k25_8gpu")
    with pytest.raises(BudgetError, match=r"short by .*Alternatives: fewer_samples"):
        check_budget(r, num_samples=10**9, avg_tokens=8192, out_dir=tmp_path)
    plan = check_budget(load_recipe("tiny_cpu"), num_samples=10, avg_tokens=100, out_dir=tmp_path / "x")
    assert plan.fits and plan.free_bytes > 0


def test_drafter_params_by_hand():
    r = load_recipe("llama31_8b_8gpu")  # H 4096, 32 heads x 128, 8 kv heads, I 14336, V' 32000
    p = drafter_trainable_params(r)
    H = 4096
    assert p["fc"] == 3 * H * H
    assert p["attn_qkvo"] == 2 * H * 4096 + 2 * (2 * H * 1024) + 4096 * H
    assert p["mlp"] == 3 * H * 14336 and p["lm_head"] == H * 32000
    assert p["total"] == p["fc"] + p["attn_qkvo"] + p["mlp"] + p["lm_head"] + 4 * H
    plan = make_plan(r, num_samples=532_000, avg_tokens=1000, loss_tokens=266_000_000, free=10**15)
    assert plan.tokens_per_param == pytest.approx(266_000_000 / p["total"])
    assert plan.paper_scale_fraction == pytest.approx(1.0)
