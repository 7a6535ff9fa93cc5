"""Study: what should the drafter learn from, for the sampling the user serves at?

Drafters for the tiny target, trained with the same step budget on the same prompts
(the demo's sample data), judged on the same held-out prompts in plain vLLM (k = 5) at the
serving profile (tiny_cpu: temperature 1.0, top_p 0.95), several seeds, with greedy and
with probabilistic drafting, and greedy as well:

  (a) from scratch on greedy regenerations
  (b) from scratch on regenerations at the serving profile
  (c) (b) with 4 samples per prompt
  (d) fine-tuned from (a)'s export on (b)'s data (train.init_from)
  (e) (b) with the full target vocabulary as draft vocabulary (no reduced vocab)
  self   the target drafting for itself (vLLM draft_model): the sampler's ceiling

    .venv/bin/python bench/study_serving.py --out out/study [--steps 200] [--seeds 3] [--prompts 64]

Prints one table (markdown). Every stage resumes, so a re-run reuses what is done.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path


def _variant(name, recipe, ingest_dir, out, init_from=None, store=None):
    from eagle_ray.export.drafter import export_drafter
    from eagle_ray.stream.run import run_generate_extract
    from eagle_ray.train.run import run_train

    d = out / name
    if store is None:
        run_generate_extract(recipe, ingest_dir, d / "generate", d / "store")
        store = d / "store"
    if init_from is not None:
        from eagle_ray.recipes import apply_overrides

        recipe = apply_overrides(recipe, [f"train.init_from={init_from}"])
    run_train(recipe, store, d / "train")
    return export_drafter(d / "train", d / "drafter"), store


def _summary(r: dict) -> dict:
    means = [s["mean_acceptance_length"] for s in r["sampled"]]
    drafts = sum(s["num_drafts"] for s in r["sampled"])
    acc = sum(sum(s["accepted_per_pos"]) for s in r["sampled"])
    return {"greedy": r["mean_acceptance_length"], "served": 1 + acc / max(1, drafts),
            "min": min(means), "max": max(means),
            "std": statistics.stdev(means) if len(means) > 1 else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/study")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--k", type=int, default=5)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from transformers import AutoTokenizer

    from eagle_ray.data.ingest import SourceSpec, ingest
    from eagle_ray.data.tokenize import length_annotator
    from eagle_ray.evaluate.acceptance import online_run_isolated, prompts_from_ingest
    from eagle_ray.job.pipeline import SAMPLE_DATA
    from eagle_ray.ops.cluster import init_ray
    from eagle_ray.recipes import load_recipe
    from eagle_ray.targets.resolve import resolve_target_path
    from eagle_ray.targets.serving import serving_profile
    from eagle_ray.vllm.engine import engine_kwargs

    out = Path(args.out).resolve()
    base = load_recipe("tiny_cpu", [f"train.max_steps={args.steps}", "train.ckpt_interval=100",
                                    f"train.eval_interval={args.steps}"])
    if not (out / "ingest" / "report.json").exists():
        ingest([SourceSpec.parse(s) for s in SAMPLE_DATA], out / "ingest", seed=base.data.seed,
               annotate=length_annotator(base))
    init_ray()
    from eagle_ray.recipes import apply_overrides

    greedy = apply_overrides(base, ["generate.temperature=0"])
    four = apply_overrides(base, ["generate.samples_per_prompt=4"])
    drafters = {}
    drafters["(a) scratch, greedy data"], _ = _variant("a", greedy, out / "ingest", out)
    drafters["(b) scratch, served data"], store_b = _variant("b", base, out / "ingest", out)
    drafters["(c) scratch, served data x4"], _ = _variant("c", four, out / "ingest", out)
    drafters["(d) from (a), served data"], _ = _variant(
        "d", base, out / "ingest", out, init_from=out / "a" / "drafter", store=store_b)
    import json as _json

    vocab = _json.loads((resolve_target_path(base.target) / "config.json").read_text())["vocab_size"]
    drafters["(e) (b), full draft vocab"], _ = _variant(
        "e", apply_overrides(base, [f"drafter.draft_vocab_size={vocab}"]), out / "ingest", out,
        store=store_b)

    model_dir = resolve_target_path(base.target)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    info = json.loads((out / "b" / "train" / "run.json").read_text())
    held = prompts_from_ingest(out / "ingest", tok, args.prompts, exclude_ids=set(info["train_ids"]))
    profile = serving_profile(base, model_dir)
    sampled = {"sampling": profile, "seeds": list(range(args.seeds))}
    ekw = engine_kwargs(base, str(model_dir))
    rows = []
    specs = {name: {"method": "eagle3", "model": str(d), "num_speculative_tokens": args.k}
             for name, d in drafters.items()}
    specs["self (target drafts for itself)"] = {"method": "draft_model", "model": str(model_dir),
                                                "num_speculative_tokens": args.k}
    specs["n-gram"] = {"method": "ngram", "num_speculative_tokens": args.k,
                       "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    for name, spec in specs.items():
        methods = ("greedy", "probabilistic") if spec["method"] != "ngram" else ("greedy",)
        for m in methods:
            r = online_run_isolated(ekw, held, base.generate.max_tokens,
                                    {**spec, "draft_sample_method": m}, sampled)
            rows.append((name, m, _summary(r)))
            print(f"{name}, {m} drafting: {rows[-1][2]}", flush=True)
    print(f"\n{len(held)} held-out prompts, k = {args.k}, {args.steps} steps each, serving profile "
          f"temperature {profile['temperature']} / top_p {profile['top_p']}, seeds "
          f"{sampled['seeds']}\n")
    print("| drafter | drafting | mean acceptance length, greedy | as served (pooled) | "
          "as served, min-max over seeds |")
    print("|---|---|---|---|---|")
    for name, m, s in rows:
        print(f"| {name} | {m} | {s['greedy']:.2f} | {s['served']:.2f} | "
              f"{s['min']:.2f}-{s['max']:.2f} |")


if __name__ == "__main__":
    main()
