"""Token statistics of a sample table (prompts.parquet, conversations.parquet, index.parquet).

Columnar (Polars, lazily scanned): a million rows take well under a second; no Python loop
per row. The table needs `num_tokens`, `num_loss_tokens` and `truncated` columns (written by
`eagle-ray ingest` and later stages) and optionally `source`, and `history_cut_tokens`
(conversations.parquet: sessions whose oldest turns were dropped to fit the window, counted
as `cut` with their `cut_tokens`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl

# Searched in this order when given a directory: the latest stage's table wins.
TABLE_NAMES = ("index.parquet", "conversations.parquet", "prompts.parquet")
REQUIRED = ("num_tokens", "num_loss_tokens", "truncated")
PERCENTILES = (0.5, 0.9, 0.99)


def find_table(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        for name in TABLE_NAMES:
            if (p / name).exists():
                return p / name
        raise FileNotFoundError(f"{p} holds none of {', '.join(TABLE_NAMES)}")
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist")
    return p


CUT = "history_cut_tokens"


def _aggs(with_ids: bool = False, with_cut: bool = False) -> list[pl.Expr]:
    t = pl.col("num_tokens")
    # Completions of one prompt are "<prompt id>#<j>" (generate.samples_per_prompt).
    prompts = ([pl.col("sample_id").str.split("#").list.first().n_unique().alias("prompts")]
               if with_ids else [])
    return [
        pl.len().alias("samples"),
        *prompts,
        t.sum().alias("total_tokens"),
        t.mean().alias("mean_tokens"),
        *[t.quantile(q, "nearest").alias(f"p{int(q * 100)}_tokens") for q in PERCENTILES],
        t.max().alias("max_tokens"),
        pl.col("num_loss_tokens").sum().alias("loss_tokens"),
        pl.col("truncated").sum().alias("truncated"),
        *([(pl.col(CUT).fill_null(0) > 0).sum().alias("cut"),
           pl.col(CUT).fill_null(0).cast(pl.Int64).sum().alias("cut_tokens")] if with_cut else []),
    ]


def compute_stats(path: str | Path) -> dict[str, Any]:
    """Overall and per-source token statistics of a sample table."""
    table = find_table(path)
    lf = pl.scan_parquet(table)
    names = lf.collect_schema().names()
    missing = [c for c in REQUIRED if c not in names]
    if missing:
        raise ValueError(f"{table} has no {', '.join(missing)} column(s); re-run "
                         "`eagle-ray ingest` with token counting on (the default)")
    ids, cut = "sample_id" in names, CUT in names
    overall = lf.select(_aggs(ids, cut)).collect().to_dicts()[0]
    if ids:
        overall["samples_per_prompt"] = overall["samples"] / max(1, overall["prompts"])
    result: dict[str, Any] = {"table": str(table), "overall": overall, "per_source": {}}
    if "source" in names:
        per = lf.group_by("source").agg(_aggs(ids, cut)).sort("source").collect()
        result["per_source"] = {r.pop("source"): r for r in per.to_dicts()}
    return result


def token_lengths(path: str | Path, *, per_turn: bool = False) -> pl.Series:
    """The num_tokens column (the planner uses it to price shorter max_seq_len); `per_turn`:
    one length per sample that regenerating every assistant turn draws (prompts.parquet's
    `turn_tokens`, written by ingest with data.train_turns=all and mode regenerate)."""
    from eagle_ray.data.tokenize import TURNS_COLUMN as TURNS

    table = find_table(path)
    if not per_turn:
        return pl.read_parquet(table, columns=["num_tokens"])["num_tokens"]
    if TURNS not in pl.scan_parquet(table).collect_schema().names():
        raise ValueError(f"{table} has no per-turn token counts ({TURNS}): it was ingested for "
                         "the final turn only; data.train_turns=all regenerates every turn, so "
                         "ingest again with it (the plan counts one sample per turn)")
    return pl.read_parquet(table, columns=[TURNS])[TURNS].explode().drop_nulls()


def format_stats(stats: dict[str, Any]) -> str:
    cols = ["samples", "total_tokens", "mean_tokens", "p50_tokens", "p90_tokens",
            "p99_tokens", "max_tokens", "loss_tokens", "truncated"]
    if "prompts" in stats["overall"]:
        cols.insert(1, "prompts")
    if "cut" in stats["overall"]:
        cols += ["cut", "cut_tokens"]
    rows = [("ALL", stats["overall"])] + list(stats["per_source"].items())
    width = max(12, *(len(name) for name, _ in rows))

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:,.1f}" if isinstance(v, float) else f"{v:,}"

    lines = [f"table: {stats['table']}",
             f"{'source':<{width}} " + " ".join(f"{c:>13}" for c in cols)]
    for name, r in rows:
        lines.append(f"{name:<{width}} " + " ".join(f"{fmt(r.get(c)):>13}" for c in cols))
    return "\n".join(lines)
