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
# # 3. Results of a finished run
#
# Training curves, acceptance per draft position (trained drafter vs an untrained one vs
# vLLM's n-gram speculation, measured offline on held-out store samples and online in
# vLLM), speed, and the train/serve feature check, all read from a finished run directory.
# No Ray, no GPU.
#
# | environment variable | default | meaning |
# |---|---|---|
# | `EAGLE_RAY_NB_RUN` | `out/demo` (what `make demo` writes; relative to the repository) | the run's output directory (`--out` of the job) |
#
# The directory holds `train/metrics.jsonl` (written by rank 0 during training),
# `evaluate/report.json` (and `report.md`, `acceptance.png`), `check.json` and
# `summary.json`.

# %%
import json
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
from IPython.display import Image, Markdown, display

from eagle_ray.job.pipeline import REPO_ROOT

RUN = Path(os.environ.get("EAGLE_RAY_NB_RUN") or "out/demo").expanduser()
if not RUN.is_absolute() and not RUN.exists():
    RUN = REPO_ROOT / RUN
if not (RUN / "evaluate" / "report.json").exists():
    raise FileNotFoundError(f"{RUN} holds no finished run (evaluate/report.json): run `make demo` "
                            "or set EAGLE_RAY_NB_RUN to a job's --out directory")
pl.Config.set_tbl_cols(-1)
pl.Config.set_tbl_width_chars(200)
pl.Config.set_tbl_hide_dataframe_shape(True)

summary = json.loads((RUN / "summary.json").read_text()) if (RUN / "summary.json").exists() else {}
report = json.loads((RUN / "evaluate" / "report.json").read_text())
metrics = [json.loads(line) for line in (RUN / "train" / "metrics.jsonl").read_text().splitlines() if line]
print(f"run {RUN}")
if summary:
    print(f"recipe {summary['recipe']['name']}, status {summary['status']}, "
          f"{summary['store_verify']['samples']:,} samples in the store, "
          f"trained to step {summary['train'].get('step')}")
    timings = summary.get("timings_s", {})
    if "generate_extract" in timings:  # streamed: one wall time for both steps
        timings = {k: v for k, v in timings.items() if k not in ("generate", "extract")}
    print("wall time per step (s):", {k: round(v) for k, v in timings.items()})

# %% [markdown]
# ## Training
#
# `train/loss` is the training loss (the target's distribution restricted to the draft
# vocabulary as teacher, summed over the TTT steps); `train/acc_stepJ` the top-1 accuracy
# of the drafter's J-th step of training-time test (step 0 predicts from the target's
# features, step J > 0 from its own J previous outputs, as when it drafts J + 1 tokens
# ahead); `val/acc_stepJ` the same on the held-out split, measured at step 0 (untrained) and
# every `train.eval_interval` steps.

# %%
train_rows = [m for m in metrics if "train/loss" in m]
val_rows = [m for m in metrics if "val/acc_step0" in m]
ttt = sorted(int(k[len("train/acc_step"):]) for k in train_rows[-1] if k.startswith("train/acc_step")) if train_rows else []

fig, axes = plt.subplots(1, 3, figsize=(16, 4))
steps = [m["step"] for m in train_rows]
axes[0].plot(steps, [m["train/loss"] for m in train_rows], marker=".")
axes[0].set_yscale("log")
axes[0].set_title("training loss")
for j in ttt:
    axes[1].plot(steps, [m[f"train/acc_step{j}"] for m in train_rows], marker=".", label=f"TTT step {j}")
    axes[2].plot([m["step"] for m in val_rows], [m[f"val/acc_step{j}"] for m in val_rows], marker="o",
                 label=f"TTT step {j}")
axes[1].set_title("training accuracy per TTT step")
axes[2].set_title("held-out accuracy per TTT step")
for ax in axes:
    ax.set_xlabel("optimizer step")
for ax in axes[1:]:
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
plt.tight_layout()
plt.show()

display(pl.DataFrame([{"step": m["step"], **{f"val acc {j}": round(m[f"val/acc_step{j}"], 3) for j in ttt}}
                      for m in val_rows]))

# %% [markdown]
# ## Acceptance per draft position
#
# The drafter proposes k tokens per step; position j's acceptance is the share of drafts
# whose first j + 1 tokens were all accepted. The mean acceptance length is pooled over
# drafts the way vLLM pools it, 1 + accepted / drafts (the 1 is the token the target emits
# itself), so it runs from 1 (nothing accepted) to k + 1. **Offline**: simulated chain
# drafting on held-out store samples (the target's stored features and argmax). **Online**:
# real speculative decoding in vLLM on held-out prompts, greedy, counted by vLLM; the
# outputs with speculation must equal the outputs without.

# %%
runs = [("offline, trained", report["offline"]), ("offline, untrained", report["offline_untrained"]),
        ("online, trained", report["online"]), ("online, untrained", report["untrained"]),
        ("online, n-gram", report["ngram"])]
k = report["k"]
display(pl.DataFrame([{"run": name, "mean acceptance length": round(r["mean_acceptance_length"], 3),
                       "drafts": r["num_drafts"],
                       **{f"pos {j}": round(p, 3) for j, p in enumerate(r["per_position_acceptance"])}}
                      for name, r in runs]))
print(f"online mean acceptance length {report['online']['mean_acceptance_length']:.3f} with k = {k} "
      f"on {report['prompts']} held-out prompts (n-gram {report['ngram']['mean_acceptance_length']:.3f}, "
      f"untrained {report['untrained']['mean_acceptance_length']:.3f}); offline "
      f"{report['offline']['mean_acceptance_length']:.3f}, gap {report['offline_online_gap']:.3f}")

fig, ax = plt.subplots(figsize=(10, 4))
width = 0.8 / len(runs)
for i, (name, r) in enumerate(runs):
    ax.bar(np.arange(k) + (i - (len(runs) - 1) / 2) * width, r["per_position_acceptance"], width,
           label=f"{name} ({r['mean_acceptance_length']:.2f})")
ax.set_xticks(np.arange(k), [f"position {j}" for j in range(k)])
ax.set_ylabel("acceptance")
ax.set_ylim(0, 1)
ax.set_title("acceptance per draft position (mean acceptance length in brackets)")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Speed
#
# Output tokens per second of each online run and its ratio to the run without speculation,
# same prompts, same engine settings. On the tiny CPU target a drafter step costs about as
# much as a target step, so these ratios say little about a large target on GPUs, where a
# target step is far more expensive than a drafter step and the mean acceptance length
# drives the speedup.

# %%
speed = [{"run": name, "output tokens": report[key]["output_tokens"], "seconds": round(report[key]["seconds"], 2),
          "tokens/s": round(report[key]["tokens_per_s"], 1),
          "speedup vs no speculation": round(report["speedup_vs_baseline"].get(key, 1.0), 3),
          "outputs identical": report["outputs_identical_by_run"].get(key, True)}
         for name, key in (("no speculation", "baseline"), ("EAGLE-3, trained", "online"),
                           ("EAGLE-3, untrained", "untrained"), ("n-gram", "ngram"))]
display(pl.DataFrame(speed))
print(f"speedup of the trained drafter: {report['speedup_vs_baseline']['online']:.2f}x; "
      f"outputs identical with and without speculation: {report['outputs_identical']}")

# %% [markdown]
# ## Train/serve check
#
# `check.json` (`eagle-ray check`): the exported drafter loaded in vLLM is fed the features
# it was trained on. vLLM's V1 and V2 model runners resolve the same aux layer ids as the
# store's, and the features vLLM hands the drafter for a store sample equal the stored ones
# within the tolerance (per layer).

# %%
check = json.loads((RUN / "check.json").read_text())
print(f"check ok: {check['ok']}; max |diff| {check['max_abs_diff']:.3g} (tolerance {check['tolerance']:.3g}) "
      f"over {check['tokens_compared']} tokens, proposer {check.get('proposer')}")
print("per layer:", {k: f"{v:.3g}" for k, v in check.get("max_abs_diff_per_layer", {}).items()})
print("aux layer ids each vLLM runner serves:", check.get("runner_layer_ids"))

# %%
Markdown((RUN / "evaluate" / "report.md").read_text())

# %% [markdown]
# ## Would more data help?
#
# `eagle-ray curve` (`OUT/curve/`, written by `eagle-ray curve --run OUT/train --prompts
# OUT/ingest --out OUT/curve`): the drafter trained on nested fractions of this run's training
# set (by prompt), the same steps each, judged on the same validation samples; the fit of mean
# acceptance length against training tokens, and its extrapolation to 2x, 5x and 10x the data
# with the store size and the time they would cost at this run's rate.

# %%
curve_dir = RUN / "curve"
if (curve_dir / "curve.json").exists():
    curve = json.loads((curve_dir / "curve.json").read_text())
    display(pl.DataFrame(curve["points"]))
    display(pl.DataFrame(curve["extrapolation"]))
    print(curve["sentence"])
    display(Image(filename=str(curve_dir / "curve.png")))
else:
    print(f"no curve for this run yet: eagle-ray curve --run {RUN / 'train'} --prompts {RUN / 'ingest'} "
          f"--out {curve_dir}")
