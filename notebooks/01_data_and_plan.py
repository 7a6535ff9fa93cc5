# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 1. Data and storage plan
#
# Ingest conversation logs (by default the bundled sample data: a small "personal" log plus
# 600 conversations sampled from a general ShareGPT file), look at what was accepted and why
# the rest was not, the token statistics per source, the length distribution, and the
# hidden-state storage plan for the tiny recipe and for the production Kimi-K2.5 recipe.
# No Ray, no GPU: it runs in seconds on a laptop.
#
# | environment variable | default | meaning |
# |---|---|---|
# | `EAGLE_RAY_NB_OUT` | a new temporary directory | where `ingest/` is written |
# | `EAGLE_RAY_NB_RECIPE` | `tiny_cpu` | recipe whose tokenizer counts the tokens |
# | `EAGLE_RAY_NB_DATA` | `eagle_ray.job.pipeline.SAMPLE_DATA` | comma-separated `PATH[:COUNT_OR_FRACTION]` sources, as `eagle-ray ingest --input` takes them |
# | `EAGLE_RAY_NB_KIMI_SAMPLES` | `100000` | conversations planned for Kimi-K2.5 |
# | `EAGLE_RAY_NB_KIMI_AVG_TOKENS` | `3000` | their average length in Kimi tokens |
# | `EAGLE_RAY_NB_KIMI_FREE_TB` | `12` | free space (TB) on the volume the Kimi store goes to |
#
# The same figures come from the CLI: `eagle-ray ingest`, `eagle-ray stats`, `eagle-ray plan`.

# %%
import json
import os
import tempfile
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
from IPython.display import display

from eagle_ray.recipes import load_recipe
from eagle_ray.job.pipeline import SAMPLE_DATA

OUT = Path(os.environ.get("EAGLE_RAY_NB_OUT") or tempfile.mkdtemp(prefix="eagle-ray-nb01-"))
RECIPE = os.environ.get("EAGLE_RAY_NB_RECIPE", "tiny_cpu")
DATA = [s.strip() for s in os.environ.get("EAGLE_RAY_NB_DATA", "").split(",") if s.strip()] or SAMPLE_DATA
KIMI_SAMPLES = int(os.environ.get("EAGLE_RAY_NB_KIMI_SAMPLES", "100000"))
KIMI_AVG_TOKENS = float(os.environ.get("EAGLE_RAY_NB_KIMI_AVG_TOKENS", "3000"))
KIMI_FREE_TB = float(os.environ.get("EAGLE_RAY_NB_KIMI_FREE_TB", "12"))

pl.Config.set_tbl_cols(-1)
pl.Config.set_tbl_width_chars(200)
pl.Config.set_fmt_str_lengths(60)
pl.Config.set_tbl_hide_dataframe_shape(True)
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, imported by transformers
recipe = load_recipe(RECIPE)
print(f"recipe {recipe.name}, output {OUT}")
for d in DATA:
    print("source", d)

# %% [markdown]
# ## Ingest
#
# Every input line ends in exactly one place: accepted (`prompts.parquet`), an exact
# duplicate of an earlier conversation (`duplicates.jsonl`), rejected with a reason
# (`rejects.jsonl`: bad JSON, unknown role, empty content, ...) or sampled out
# (`sampled_out.jsonl`, when a source is given as `PATH:N` or `PATH:FRACTION`). Sample ids
# are content hashes, so ingesting again gives the same ids.

# %%
from eagle_ray.data.ingest import SourceSpec, ingest
from eagle_ray.data.tokenize import length_annotator

ingest_dir = OUT / "ingest"
ingest([SourceSpec.parse(s) for s in DATA], ingest_dir, seed=recipe.data.seed,
       annotate=length_annotator(recipe))
report = json.loads((ingest_dir / "report.json").read_text())
COUNTS = ["lines_read", "accepted", "duplicates", "rejected", "sampled_out"]
display(pl.DataFrame([{"source": "ALL", **{k: report[k] for k in COUNTS}}]
                     + [{"source": p, **{k: v[k] for k in COUNTS}}
                        for p, v in report["per_source"].items()]))
print(f"accepted {report['accepted']:,} + duplicates {report['duplicates']:,} + rejected "
      f"{report['rejected']:,} + sampled out {report['sampled_out']:,} = lines read "
      f"{report['lines_read']:,}: {'holds' if report['invariant']['holds'] else 'BROKEN'}")
print("reject reasons:", report["reject_reasons"])
for line in (ingest_dir / "rejects.jsonl").read_text().splitlines()[:5]:
    r = json.loads(line)
    print(f"  rejected {r['source']} line {r['line']}: {r['reason']}")

# %% [markdown]
# ## Token statistics per source
#
# Counted with the recipe's tokenizer over the chat template, exactly as the target will see
# the conversation: `total_tokens` is prompt + final answer (what extraction runs the
# target's prefill over), `loss_tokens` the tokens the drafter learns to predict (the final
# assistant turn: `<think>` block, answer, end-of-turn), `truncated` the samples longer
# than `data.max_seq_len` (cut from the end).

# %%
from eagle_ray.data.stats import compute_stats, token_lengths

stats = compute_stats(ingest_dir)
display(pl.DataFrame([{"source": "ALL", **stats["overall"]}]
                     + [{"source": s, **v} for s, v in stats["per_source"].items()]))

# %%
table = pl.read_parquet(ingest_dir / "prompts.parquet", columns=["source", "num_tokens", "num_loss_tokens"])
fig, axes = plt.subplots(1, 2, figsize=(13, 4))
for ax, col, title in ((axes[0], "num_tokens", "tokens per sample (prompt + answer)"),
                       (axes[1], "num_loss_tokens", "loss tokens per sample (final answer)")):
    bins = np.histogram_bin_edges(table[col].to_numpy(), bins=40)
    for part in table.partition_by("source", maintain_order=True):
        ax.hist(part[col].to_numpy(), bins=bins, alpha=0.6,
                label=f"{part['source'][0]} ({part.height:,})")
    ax.set_title(title)
    ax.set_xlabel("tokens")
    ax.set_ylabel("samples")
    ax.legend()
axes[0].axvline(recipe.data.max_seq_len, color="k", ls="--", lw=1)
axes[0].text(recipe.data.max_seq_len, axes[0].get_ylim()[1] * 0.9, " max_seq_len", fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Storage plan: the tiny recipe
#
# The store keeps, for every token, the target's hidden states at the three auxiliary
# layers plus the final (normed) state: (3 + 1) x H values, plus 5 bytes for the token id
# (int32) and the loss-mask byte. The tiny target has H = 128, so bf16 costs
# 4 x 128 x 2 = 1,024 bytes per token. `plan` multiplies that by the ingested token count,
# compares it with the free space where the store will go (less `storage.headroom`), and
# sizes the drafter: tokens per trainable parameter, and the sample count as a fraction of
# the EAGLE-3 paper's ~532K conversations.

# %%
from eagle_ray.plan.budget import (format_plan, hidden_bytes_per_token, make_plan,
                                   plan_from_stats, store_bytes_per_token)

lengths = token_lengths(ingest_dir).to_numpy()
tiny_plan = plan_from_stats(recipe, stats, lengths, out_dir=OUT / "store")
print(format_plan(tiny_plan))

# %% [markdown]
# The planner lists alternatives only when the store does not fit. To see them on this
# data, the same plan on a volume with 60% of the space it needs: fewer samples, a shorter
# `max_seq_len` priced on the real length distribution above (every sample truncated at
# that length), and fp8 storage.

# %%
small = make_plan(recipe, num_samples=tiny_plan.num_samples, avg_tokens=tiny_plan.avg_tokens,
                  loss_tokens=tiny_plan.loss_tokens, lengths=lengths, out_dir=OUT / "store",
                  free=int(tiny_plan.total_bytes * 0.6 / (1 - recipe.storage.headroom)))
print(format_plan(small))

# %% [markdown]
# ## Storage plan: Kimi-K2.5 (`kimi_k25_8gpu`)
#
# Kimi-K2.5's text model has H = 7,168 and 61 layers; the recipe captures layers 2, 30
# and 58 plus the final state. In bf16 that is **4 x 7168 x 2 = 57,344 bytes per token**
# (57,349 with the id and mask): a 3,000-token conversation is 172 MB of features, and
# 100,000 of them are 17 TB. The recipe has no sample count of its own (it depends on your
# data), so the plan below prices `EAGLE_RAY_NB_KIMI_SAMPLES` conversations of
# `EAGLE_RAY_NB_KIMI_AVG_TOKENS` tokens on a volume with `EAGLE_RAY_NB_KIMI_FREE_TB` TB free,
# the same as `eagle-ray plan --recipe kimi_k25_8gpu --set data.num_samples=... --set
# data.avg_tokens_per_sample=...` run on that volume.

# %%
kimi = load_recipe("kimi_k25_8gpu")
t = kimi.target
layers = len(t.resolved_aux_layer_ids) + 1
for dtype in ("bf16", "fp8_e4m3"):
    print(f"{dtype:>9}: {layers} x {t.hidden_size:,} x {'2' if dtype == 'bf16' else '1 (+ 4-byte scale per layer)'}"
          f" = {hidden_bytes_per_token(t, dtype):,} bytes/token of features, "
          f"{store_bytes_per_token(t, dtype):,} with id and mask")
kimi_plan = make_plan(kimi, num_samples=KIMI_SAMPLES, avg_tokens=KIMI_AVG_TOKENS,
                      out_dir=kimi.storage.out_dir, free=int(KIMI_FREE_TB * 1e12))
print()
print(format_plan(kimi_plan))

# %%
TB = 1e12
options = [{"option": f"as planned ({kimi_plan.dtype}, max_seq_len {kimi_plan.max_seq_len:,})",
            "samples": kimi_plan.num_samples, "max_seq_len": kimi_plan.max_seq_len,
            "store_TB": round(kimi_plan.total_bytes / TB, 2), "fits": kimi_plan.fits}]
for a in kimi_plan.alternatives:
    options.append({"option": a["kind"], "samples": a["num_samples"], "max_seq_len": a["max_seq_len"],
                    "store_TB": round(a["bytes"] / TB, 2), "fits": a.get("fits", True)})
display(pl.DataFrame(options))

fig, ax = plt.subplots(figsize=(9, 3))
ax.barh([o["option"] for o in options], [o["store_TB"] for o in options],
        color=["tab:green" if o["fits"] else "tab:red" for o in options])
ax.axvline(kimi_plan.usable_bytes / TB, color="k", ls="--", lw=1)
ax.text(kimi_plan.usable_bytes / TB, -0.6, " usable", fontsize=8)
ax.set_xlabel("store size (TB)")
ax.invert_yaxis()
plt.tight_layout()
plt.show()

# %% [markdown]
# What the figures mean:
#
# - **bytes / token**: the price of one token in the store, fixed by the target (H, the
#   number of captured layers) and `storage.dtype`. It does not depend on the data.
# - **store size** = tokens x bytes / token; **fits** compares it with the free space less
#   the headroom; **short by** is how much is missing. Every writing stage runs the same
#   check and refuses to start when the plan misses.
# - **fewer_samples**: the most samples of the average length that fit at the current
#   `max_seq_len`; a smaller store, less training data.
# - **shorter_max_seq_len**: the longest `max_seq_len` at which every sample fits.
#   Samples are cut from the end, so long conversations lose the end of their final answer
#   (the part the drafter learns from). Given only an average length (as here) it is an
#   estimate that caps the average; with `--stats` of a real ingest it is priced on the
#   real length distribution, as in the tiny example above.
# - **storage.dtype=fp8_e4m3**: one byte per value plus a 4-byte scale per token and layer:
#   28,688 bytes per token for Kimi-K2.5, half of bf16, at the cost of precision in the
#   features the drafter trains on (`eagle-ray check` compares what vLLM serves with what
#   was stored).
# - **drafter trainable params / tokens per param / paper scale**: whether the data set is
#   large enough for a drafter this size (one decoder layer at the target's width plus its
#   fc and draft head), against the EAGLE-3 paper's ~532K conversations.
