"""Storage and data-scale planning: will the hidden-state store fit, and is it enough data?

Hidden-state bytes per token = (aux layers + final) x H x bytes per element; for the
default 3 aux layers that is 4H elements (Kimi-K2.5 at bf16: 4 x 7168 x 2 = 57,344 B).
fp8_e4m3 stores one byte per element plus one fp32 scale per token per captured layer.
Each token also stores input_ids (int32) and loss_mask (uint8): 5 bytes.

`check_budget` is what every writing stage calls before it starts; it raises
`BudgetError` saying by how much the plan misses.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from eagle_ray.common.errors import UserFault
from eagle_ray.config import Recipe, TargetConfig

BYTES_PER_ELEMENT = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1}
FP8_SCALE_BYTES = 4
TOKEN_META_BYTES = 4 + 1  # input_ids int32 + loss_mask uint8

# EAGLE-3 paper (Li et al., 2025): ShareGPT + UltraChat, ~532K conversations.
PAPER_SAMPLES = 532_000


class BudgetError(UserFault, RuntimeError):
    """The planned store does not fit in the free space at its output path."""


def feature_bytes_per_token(num_aux_layers: int, hidden_size: int, dtype: str) -> int:
    """Bytes of one token's features (aux layers + the final feature, fp8 scales)."""
    layers = num_aux_layers + 1
    per = layers * hidden_size * BYTES_PER_ELEMENT[dtype]
    if dtype == "fp8_e4m3":
        per += layers * FP8_SCALE_BYTES
    return per


def hidden_bytes_per_token(target: TargetConfig, dtype: str) -> int:
    return feature_bytes_per_token(len(target.resolved_aux_layer_ids), target.hidden_size, dtype)


def store_bytes_per_token(target: TargetConfig, dtype: str) -> int:
    return hidden_bytes_per_token(target, dtype) + TOKEN_META_BYTES


def drafter_trainable_params(recipe: Recipe) -> dict[str, int]:
    """Trainable parameters of the EAGLE-3 drafter (target embeddings are frozen, not counted)."""
    H = recipe.target.hidden_size
    heads = recipe.drafter.num_attention_heads or recipe.target.num_attention_heads
    kv_heads = recipe.drafter.num_key_value_heads or heads
    head_dim = H // heads
    inter = recipe.target.intermediate_size
    parts = {
        "fc": 3 * H * H,  # fuse the 3 aux features
        "attn_qkvo": 2 * H * heads * head_dim + 2 * (2 * H * kv_heads * head_dim) + heads * head_dim * H,
        "mlp": 3 * H * inter,
        "norms": 4 * H,  # input, hidden (feature), post-attention, final
        "lm_head": H * recipe.drafter.draft_vocab_size,
    }
    parts["total"] = sum(parts.values())
    return parts


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem that holds path (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


@dataclass
class Plan:
    recipe: str
    dtype: str
    hidden_size: int
    aux_layer_ids: list[int]
    num_samples: int
    avg_tokens: float
    max_seq_len: int
    loss_tokens: int | None
    hidden_bytes_per_token: int
    store_bytes_per_token: int
    total_tokens: int
    total_bytes: int
    out_dir: str
    free_bytes: int
    usable_bytes: int
    fits: bool
    shortfall_bytes: int
    drafter_params: dict[str, int]
    tokens_per_param: float
    paper_scale_fraction: float
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    turns_of: int | None = None
    """Regenerating every assistant turn: the sessions the samples are the turns of."""
    non_text_share: dict[str, float] = field(default_factory=dict)
    """Per source, the share of its sessions ingest rejected for image (non-text) parts: the
    traffic this plan does not train on (the capture is text only)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _max_len_that_fits(lengths: np.ndarray | None, num_samples: int, avg: float,
                       budget_tokens: float, cur_len: int) -> int | None:
    """Largest max_seq_len whose truncated token total fits (exact with lengths, else avg-capped)."""
    lo, hi = 16, cur_len
    if lengths is not None:
        def total(L: int) -> float:
            return float(np.minimum(lengths, L).sum())
    else:
        def total(L: int) -> float:
            return num_samples * min(avg, L)
    if total(lo) > budget_tokens:
        return None
    while lo < hi:  # binary search on a monotone total
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if total(mid) <= budget_tokens else (lo, mid - 1)
    return lo


def make_plan(recipe: Recipe, *, num_samples: int, avg_tokens: float,
              loss_tokens: int | None = None, lengths: Sequence[int] | None = None,
              out_dir: str | Path | None = None, free: int | None = None) -> Plan:
    """The storage plan for num_samples samples averaging avg_tokens tokens (after truncation)."""
    if num_samples <= 0 or avg_tokens <= 0:
        raise ValueError(f"need num_samples > 0 and avg_tokens > 0, got {num_samples}, {avg_tokens}")
    target, dtype = recipe.target, recipe.storage.dtype
    out = str(out_dir or recipe.storage.out_dir)
    free = free_bytes(out) if free is None else free
    usable = int(free * (1 - recipe.storage.headroom))
    per_tok = store_bytes_per_token(target, dtype)
    total_tokens = int(round(num_samples * avg_tokens))
    total = total_tokens * per_tok
    params = drafter_trainable_params(recipe)
    train_tokens = loss_tokens if loss_tokens is not None else total_tokens
    plan = Plan(
        recipe=recipe.name, dtype=dtype, hidden_size=target.hidden_size,
        aux_layer_ids=list(target.resolved_aux_layer_ids), num_samples=num_samples,
        avg_tokens=float(avg_tokens), max_seq_len=recipe.data.max_seq_len, loss_tokens=loss_tokens,
        hidden_bytes_per_token=hidden_bytes_per_token(target, dtype), store_bytes_per_token=per_tok,
        total_tokens=total_tokens, total_bytes=total, out_dir=out, free_bytes=free,
        usable_bytes=usable, fits=total <= usable, shortfall_bytes=max(0, total - usable),
        drafter_params=params, tokens_per_param=train_tokens / params["total"],
        paper_scale_fraction=num_samples / PAPER_SAMPLES)
    if not plan.fits:
        budget_tokens = usable / per_tok
        n_fit = int(budget_tokens // avg_tokens)
        plan.alternatives.append({"kind": "fewer_samples", "num_samples": n_fit,
                                  "max_seq_len": recipe.data.max_seq_len,
                                  "bytes": int(n_fit * avg_tokens * per_tok)})
        arr = np.asarray(lengths, dtype=np.int64) if lengths is not None else None
        L = _max_len_that_fits(arr, num_samples, avg_tokens, budget_tokens, recipe.data.max_seq_len)
        if L is not None:
            tot = (np.minimum(arr, L).sum() if arr is not None else num_samples * min(avg_tokens, L))
            plan.alternatives.append({"kind": "shorter_max_seq_len", "num_samples": num_samples,
                                      "max_seq_len": L, "bytes": int(tot * per_tok)})
        if dtype != "fp8_e4m3":
            fp8 = store_bytes_per_token(target, "fp8_e4m3")
            plan.alternatives.append({"kind": "storage.dtype=fp8_e4m3", "num_samples": num_samples,
                                      "max_seq_len": recipe.data.max_seq_len,
                                      "bytes": total_tokens * fp8, "fits": total_tokens * fp8 <= usable})
    return plan


def check_budget(recipe: Recipe, *, num_samples: int, avg_tokens: float,
                 out_dir: str | Path | None = None) -> Plan:
    """Raise BudgetError (with the shortfall and what would fit) unless the store fits."""
    plan = make_plan(recipe, num_samples=num_samples, avg_tokens=avg_tokens, out_dir=out_dir)
    if not plan.fits:
        alts = "; ".join(f"{a['kind']}: {a['num_samples']:,} samples at max_seq_len "
                         f"{a['max_seq_len']:,} ({_gb(a['bytes'])})" for a in plan.alternatives)
        raise BudgetError(
            f"hidden-state store needs {_gb(plan.total_bytes)} at {plan.out_dir} but only "
            f"{_gb(plan.usable_bytes)} is usable ({_gb(plan.free_bytes)} free, "
            f"{recipe.storage.headroom:.0%} headroom): short by {_gb(plan.shortfall_bytes)}. "
            f"Alternatives: {alts}")
    return plan


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"


def format_plan(plan: Plan) -> str:
    p = plan
    lines = [
        f"recipe                  {p.recipe}",
        f"target hidden size      {p.hidden_size:,}   aux layers {p.aux_layer_ids} + final",
        f"storage dtype           {p.dtype}",
        f"hidden bytes / token    {p.hidden_bytes_per_token:,}   (+{TOKEN_META_BYTES} for ids and "
        f"mask = {p.store_bytes_per_token:,})",
        *([f"sessions                {p.turns_of:,}   every assistant turn regenerated "
           f"(data.train_turns=all): {p.num_samples / max(1, p.turns_of):,.1f} samples each"]
          if p.turns_of else []),
        f"samples                 {p.num_samples:,}   x {p.avg_tokens:,.1f} tokens avg "
        f"(max_seq_len {p.max_seq_len:,}) = {p.total_tokens:,} tokens",
        f"store size              {_gb(p.total_bytes)}",
        f"free at {p.out_dir:<15} {_gb(p.free_bytes)}   (usable {_gb(p.usable_bytes)})",
        f"fits                    {'yes' if p.fits else 'NO, short by ' + _gb(p.shortfall_bytes)}",
        *(f"not trained on          {src}: {share:.1%} of its sessions (image parts, rejected "
          "non_text_part: the capture is text only)" for src, share in p.non_text_share.items()),
    ]
    for a in p.alternatives:
        extra = "" if a.get("fits", True) else " (does not fit either)"
        lines.append(f"  alternative: {a['kind']:<24} {a['num_samples']:,} samples, max_seq_len "
                     f"{a['max_seq_len']:,}, {_gb(a['bytes'])}{extra}")
    dp = p.drafter_params
    what = "loss tokens" if p.loss_tokens is not None else "tokens"
    lines += [
        f"drafter trainable params {dp['total']:,}   (fc {dp['fc']:,}, attention {dp['attn_qkvo']:,}, "
        f"mlp {dp['mlp']:,}, lm_head {dp['lm_head']:,})",
        f"{what} per param{'':<{8 if what == 'tokens' else 3}}{p.tokens_per_param:,.3f}",
        f"vs EAGLE-3 paper scale  {p.num_samples:,} / {PAPER_SAMPLES:,} samples = "
        f"{p.paper_scale_fraction:.1%}",
    ]
    return "\n".join(lines)


def plan_from_stats(recipe: Recipe, stats: dict[str, Any], lengths: Sequence[int] | None = None,
                    out_dir: str | Path | None = None) -> Plan:
    """The plan for an ingested or generated table's samples. Regenerating every turn of a
    prompts.parquet, `lengths` are its per-turn sample lengths (`token_lengths(per_turn=True)`):
    samples and tokens grow with the turns, and the plan says so (`turns_of`)."""
    o = stats["overall"]
    if recipe.regenerates_every_turn and str(stats["table"]).endswith("prompts.parquet"):
        if lengths is None:
            raise ValueError("data.train_turns=all regenerates every turn: the plan needs the "
                             "per-turn lengths (data.stats.token_lengths(per_turn=True))")
        per = recipe.generate.samples_per_prompt
        lengths = [x for x in lengths for _ in range(per)]
        if not lengths:
            raise ValueError(f"stats of {stats['table']} show no turns; nothing to plan")
        plan = make_plan(recipe, num_samples=int(recipe.data.num_samples or len(lengths)),
                         avg_tokens=float(recipe.data.avg_tokens_per_sample or np.mean(lengths)),
                         lengths=lengths if not recipe.data.num_samples else None, out_dir=out_dir)
        plan.turns_of = int(o["samples"])
        return plan
    # An ingest table holds prompts: generation draws samples_per_prompt samples from each.
    per = (recipe.generate.samples_per_prompt
           if str(stats["table"]).endswith("prompts.parquet") else 1)
    n = int(recipe.data.num_samples or o["samples"] * per)
    avg = float(recipe.data.avg_tokens_per_sample or o["mean_tokens"] or 0)
    if n == 0 or avg == 0:
        raise ValueError(f"stats of {stats['table']} show no tokens; nothing to plan")
    loss = int(o["loss_tokens"] * n / o["samples"]) if o["loss_tokens"] else None
    if lengths is not None and per > 1 and n == o["samples"] * per:
        lengths = [x for x in lengths for _ in range(per)]  # each prompt's length, N times
    return make_plan(recipe, num_samples=n, avg_tokens=avg, loss_tokens=loss,
                     lengths=lengths if n == o["samples"] * per else None, out_dir=out_dir)


def plan_for_table(recipe: Recipe, path: str | Path, out_dir: str | Path | None = None
                   ) -> tuple[dict[str, Any], Plan]:
    """(stats, plan) of a sample table or stage directory (`eagle-ray plan --stats`, the
    job's plan step): per-turn lengths where every turn of the prompts is regenerated."""
    from eagle_ray.data.stats import compute_stats, token_lengths

    stats = compute_stats(path)
    per_turn = recipe.regenerates_every_turn and str(stats["table"]).endswith("prompts.parquet")
    lengths = token_lengths(path, per_turn=per_turn).to_numpy()
    plan = plan_from_stats(recipe, stats, lengths, out_dir=out_dir)
    report = Path(stats["table"]).parent / "report.json"  # ingest's, beside its prompts.parquet
    if report.exists():
        shares = json.loads(report.read_text()).get("non_text_share") or {}
        plan = dataclasses.replace(plan, non_text_share={k: float(v) for k, v in shares.items()})
    return stats, plan


def plan_from_recipe(recipe: Recipe, out_dir: str | Path | None = None) -> Plan:
    d = recipe.data
    if d.num_samples is None or d.avg_tokens_per_sample is None:
        raise ValueError(
            f"recipe {recipe.name} has no sample count/length: pass --stats DIR (from `eagle-ray "
            "ingest`) or --set data.num_samples=N --set data.avg_tokens_per_sample=T")
    return make_plan(recipe, num_samples=d.num_samples, avg_tokens=d.avg_tokens_per_sample,
                     out_dir=out_dir)


__all__ = ["BudgetError", "Plan", "check_budget", "drafter_trainable_params", "format_plan",
           "free_bytes", "hidden_bytes_per_token", "make_plan", "plan_for_table", "plan_from_recipe",
           "plan_from_stats", "store_bytes_per_token"]
