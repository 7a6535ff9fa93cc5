import numpy as np
import polars as pl
import pytest

from eagle_ray.data.stats import compute_stats, format_stats


def test_stats_overall_and_per_source(tmp_path):
    rng = np.random.default_rng(0)
    n = 10_000
    tokens = rng.integers(5, 3000, n)
    df = pl.DataFrame({"source": np.where(np.arange(n) % 4 == 0, "mine.jsonl", "general.jsonl"),
                       "num_tokens": tokens, "num_loss_tokens": tokens // 2,
                       "truncated": tokens > 2900})
    df.write_parquet(tmp_path / "prompts.parquet")
    s = compute_stats(tmp_path)
    o = s["overall"]
    assert o["samples"] == n and o["total_tokens"] == tokens.sum()
    assert o["mean_tokens"] == pytest.approx(tokens.mean())
    assert o["p50_tokens"] == np.sort(tokens)[round(0.5 * (n - 1))]
    assert o["max_tokens"] == tokens.max() and o["truncated"] == (tokens > 2900).sum()
    assert o["loss_tokens"] == (tokens // 2).sum()
    mine = s["per_source"]["mine.jsonl"]
    assert mine["samples"] == n // 4 and mine["total_tokens"] == tokens[::4].sum()
    assert s["per_source"]["general.jsonl"]["samples"] == n - n // 4
    text = format_stats(s)
    assert "mine.jsonl" in text and f"{n:,}" in text


def test_stats_needs_token_columns(tmp_path):
    pl.DataFrame({"sample_id": ["a"]}).write_parquet(tmp_path / "prompts.parquet")
    with pytest.raises(ValueError, match="num_tokens"):
        compute_stats(tmp_path / "prompts.parquet")
    with pytest.raises(FileNotFoundError):
        compute_stats(tmp_path / "nothing")
