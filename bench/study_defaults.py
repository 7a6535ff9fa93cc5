"""Study: which drafter and training settings win on a real target (issue 30, part 6).

Every variant trains from the SAME store, for the SAME number of steps, with the same
validation split (stable hash of the sample id: `train.val_fraction` is held fixed), and is
judged offline on that split: greedy acceptance at k, and at the serving profile as expected
from the store (greedy and probabilistic drafting, eagle_ray.evaluate.served). Several seeds
per variant (`train.seed`: initialisation and batch order); the table gives the mean, the
spread across seeds, and the difference from the baseline (the recipe as given).

    .venv/bin/python bench/study_defaults.py --store out/real/store --out out/study \\
        [--recipe smollm2_cpu] [--steps 150] [--seeds 0,1] [--baseline-seeds 0,1,2] [--set SECTION.FIELD=VALUE ...] \\
        [--variant NAME=SECTION.FIELD=VALUE[,SECTION.FIELD=VALUE ...] ...] [--only NAME,NAME]

Without --variant it runs the default list below (TTT length, draft vocabulary, layers,
learning rate and schedule, twice the steps, starting from the target's weights). `--set`
applies to every variant, baseline included (e.g. the bench's data window). A variant that
draws a different draft vocabulary rebuilds it from the same training split. Every
(variant, seed) is one `eagle-ray train` run under OUT/NAME/seed-S; a killed study re-run
skips finished runs and resumes unfinished ones.
Prints one markdown table and writes OUT/study.json and OUT/study.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

VARIANTS: dict[str, list[str]] = {
    "baseline": [],
    "ttt=1": ["drafter.ttt_steps=1"],
    "ttt=5": ["drafter.ttt_steps=5"],
    "ttt=7": ["drafter.ttt_steps=7"],
    "vocab=2048": ["drafter.draft_vocab_size=2048"],
    "vocab=32000": ["drafter.draft_vocab_size=32000"],
    "layers=2": ["drafter.num_layers=2"],
    "lr=1e-3": ["train.lr=1e-3"],
    "lr=1e-2": ["train.lr=1e-2"],
    "schedule=constant": ["train.lr_schedule=constant"],
    "schedule=linear": ["train.lr_schedule=linear"],
    "init=lm_head": ["train.init_from_target=lm_head"],
    "init=layer": ["train.init_from_target=layer"],
}


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, sets = text.partition("=")
    if not name or not sets or "=" not in sets:
        raise SystemExit(f"--variant {text!r}: expected NAME=SECTION.FIELD=VALUE[,SECTION.FIELD=VALUE ...]")
    return name, [s for s in sets.split(",") if s]


def run_one(recipe_name: str, sets: list[str], store: Path, run_dir: Path, k_sampling) -> dict:
    """Train one (variant, seed) to its steps (resuming), then judge it offline; cached in
    RUN/study_point.json, keyed by the overrides that made it."""
    from safetensors.torch import load_file

    from eagle_ray.evaluate.acceptance import offline_acceptance
    from eagle_ray.recipes import load_recipe
    from eagle_ray.train.checkpoint import newest_loadable
    from eagle_ray.train.run import run_train

    point_file = run_dir / "study_point.json"
    if point_file.exists():
        point = json.loads(point_file.read_text())
        if point.get("sets") == sets:
            return point
        raise SystemExit(f"{run_dir} holds a run of other settings ({point.get('sets')}); use a new --out")
    recipe = load_recipe(recipe_name, sets)
    t0 = time.time()
    run_train(recipe, store, run_dir)
    wall = time.time() - t0
    info = json.loads((run_dir / "run.json").read_text())
    ck = newest_loadable(run_dir)
    k, sampling = k_sampling(recipe)
    off = offline_acceptance(info, load_file(str(ck / "model.safetensors")), k, sampling=sampling)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    rates = [m["train/tokens_per_s"] for m in metrics if "train/tokens_per_s" in m][-5:]
    point = {"sets": sets, "greedy": off["mean_acceptance_length"],
             "per_position": off.get("per_position_acceptance"),
             "train_wall_s": wall, "tokens_per_s": sum(rates) / len(rates) if rates else None,
             "val_samples": min(len(info["val_ids"]), 256),
             "draft_vocab_coverage": info.get("draft_vocab_coverage")}
    served = off.get("as_served") or {}
    if served:
        point["as_served_probabilistic"] = served["probabilistic_drafting"]["mean_acceptance_length"]
        point["as_served_greedy_drafting"] = served["greedy_drafting"]["mean_acceptance_length"]
    tmp = point_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(point, indent=1))
    tmp.replace(point_file)
    return point


def _stat(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def table(results: dict[str, list[dict]], metrics: list[str]) -> str:
    base = {m: _stat([p[m] for p in results["baseline"]])[0] for m in metrics} if "baseline" in results else {}
    head = (["variant", "seeds"] + [f"{m.replace('_', ' ')} (mean ± sd, vs baseline)" for m in metrics]
            + ["train tokens/s", "draft vocab coverage"])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, points in results.items():
        cells = [name, str(len(points))]
        for m in metrics:
            mean, sd = _stat([p[m] for p in points])
            delta = f", {mean - base[m]:+.3f}" if base and name != "baseline" else ""
            cells.append(f"{mean:.3f} ± {sd:.3f}{delta}")
        rates = [p["tokens_per_s"] for p in points if p.get("tokens_per_s")]
        cells.append(f"{statistics.fmean(rates):,.0f}" if rates else "-")
        cover = [p["draft_vocab_coverage"] for p in points if p.get("draft_vocab_coverage") is not None]
        cells.append(f"{100 * statistics.fmean(cover):.1f}%" if cover else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True, help="a hidden-state store of the target (e.g. the bench's)")
    p.add_argument("--out", default="out/study")
    p.add_argument("--recipe", default="smollm2_cpu")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--baseline-seeds", default=None,
                   help="seeds of the baseline alone (default: --seeds): more of them price the noise "
                        "that a one-seed variant's difference must exceed")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=SECTION.FIELD=VALUE,...")
    p.add_argument("--only", default=None, help="comma-separated variant names to run (baseline always)")
    args = p.parse_args(argv)

    from eagle_ray.common import logs
    from eagle_ray.targets.resolve import resolve_target_path
    from eagle_ray.targets.serving import serving_profile

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    logs.setup(out)
    variants = (dict(parse_variant(v) for v in args.variant) if args.variant
                else {**VARIANTS, f"steps={2 * args.steps}": [f"train.max_steps={2 * args.steps}"]})
    variants.setdefault("baseline", [])
    variants = {"baseline": variants.pop("baseline"), **variants}
    if args.only:
        keep = {"baseline", *args.only.split(",")}
        unknown = keep - set(variants)
        if unknown:
            raise SystemExit(f"--only: unknown variants {sorted(unknown)}; known: {', '.join(variants)}")
        variants = {n: s for n, s in variants.items() if n in keep}
    seeds = [int(s) for s in args.seeds.split(",")]
    base_seeds = [int(s) for s in (args.baseline_seeds or args.seeds).split(",")]
    # Steps fixed, one evaluation and checkpoint at the end: the variants differ only in the setting.
    common = list(args.set) + [f"train.max_steps={args.steps}", f"train.eval_interval={args.steps}",
                               f"train.ckpt_interval={args.steps}", "train.keep_checkpoints=1"]

    def k_sampling(recipe):
        profile = serving_profile(recipe, resolve_target_path(recipe.target))
        return recipe.drafter.num_speculative_tokens, (profile if profile["temperature"] > 0 else None)

    results: dict[str, list[dict]] = {}
    t0 = time.time()
    for name, sets in variants.items():
        for s in (base_seeds if name == "baseline" else seeds):
            print(f"study: {name} seed {s} ({time.time() - t0:,.0f} s in)", flush=True)
            results.setdefault(name, []).append(
                run_one(args.recipe, common + sets + [f"train.seed={s}"], Path(args.store).resolve(),
                        out / name.replace("/", "_") / f"seed-{s}", k_sampling))
    metrics = [m for m in ("greedy", "as_served_probabilistic", "as_served_greedy_drafting")
               if all(m in p for ps in results.values() for p in ps)]
    md = table(results, metrics)
    head = (f"recipe {args.recipe}, store {args.store}, {args.steps} steps, seeds {args.seeds}, "
            f"common settings {' '.join(args.set) or '(none)'}; offline on "
            f"{results['baseline'][0]['val_samples']} held-out samples")
    (out / "study.json").write_text(json.dumps({"head": head, "variants": variants, "results": results}, indent=1))
    (out / "study.md").write_text(head + "\n\n" + md + "\n")
    print(head + "\n\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
