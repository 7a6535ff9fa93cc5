"""The end-to-end pipeline, stage by stage (the job in jobs/end_to_end.py calls this).

Stages so far: target (build the tiny target on first use) -> ingest -> stats -> plan ->
generate (Ray Data -> vLLM replicas) -> extract (Ray Data -> extractor actors -> store) ->
train (Ray Train DDP) -> export (vLLM drafter dir) -> check (train/serve features) -> evaluate
(offline + online acceptance vs untrained and n-gram).
Each stage writes under OUT/<stage>/ and can be re-run on its own with the CLI.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from eagle_ray.config import Recipe, resolve_target_path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE_DATA = [str(REPO_ROOT / "examples" / "data" / "personal.jsonl"),
               str(REPO_ROOT / "examples" / "data" / "general_sharegpt.jsonl") + ":600"]


def run_end_to_end(recipe: Recipe, inputs: list[str], out_dir: str | Path) -> dict:
    from eagle_ray.data.ingest import SourceSpec, ingest
    from eagle_ray.data.stats import compute_stats, format_stats, token_lengths
    from eagle_ray.data.tokenize import length_annotator
    from eagle_ray.plan.budget import format_plan, plan_from_stats

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    t0 = time.time()
    target_dir = resolve_target_path(recipe.target)
    timings["target"] = time.time() - t0
    logger.info("target: %s", target_dir)

    t0 = time.time()
    res = ingest([SourceSpec.parse(s) for s in inputs], out / "ingest", seed=recipe.data.seed,
                 annotate=length_annotator(recipe))
    timings["ingest"] = time.time() - t0
    print(f"ingest: accepted {res.accepted:,} + duplicates {res.duplicates:,} + rejected "
          f"{res.rejected:,} + sampled out {res.sampled_out:,} = lines read {res.lines_read:,}")
    if res.accepted == 0:
        raise ValueError("no sample was accepted; see " + str(out / "ingest" / "rejects.jsonl"))

    t0 = time.time()
    stats = compute_stats(out / "ingest")
    timings["stats"] = time.time() - t0
    print(format_stats(stats))

    plan = plan_from_stats(recipe, stats, token_lengths(out / "ingest").to_numpy(),
                           out_dir=out / "store")
    print(format_plan(plan))
    from eagle_ray.generate.run import run_generate

    t0 = time.time()
    gen = run_generate(recipe, out / "ingest", out / "generate")
    timings["generate"] = time.time() - t0
    print(f"generate: {gen.generated:,} conversations, {gen.rejected:,} rejected, "
          f"{gen.completion_tokens:,} completion tokens this run -> {out / 'generate'}")
    gen_stats = compute_stats(out / "generate")
    print(format_stats(gen_stats))

    from eagle_ray.extract.run import run_extract
    from eagle_ray.store.reader import verify_store

    t0 = time.time()
    ext = run_extract(recipe, out / "generate", out / "store")
    timings["extract"] = time.time() - t0
    check = verify_store(out / "store")
    print(f"extract: {ext.extracted:,} samples, {ext.tokens:,} tokens this run -> {out / 'store'}; "
          f"store verify: {check['samples']:,} samples in {check['shards']:,} shards, "
          f"{'OK' if check['ok'] else 'PROBLEMS: ' + str(check['problems'][:3])}")

    from eagle_ray.train.run import run_train

    t0 = time.time()
    train = run_train(recipe, out / "store", out / "train")
    timings["train"] = time.time() - t0
    print(f"train: step {train.get('step')}, held-out step-0 accuracy "
          f"{train.get('val/acc_step0', float('nan')):.3f}, step-1 "
          f"{train.get('val/acc_step1', float('nan')):.3f} -> {out / 'train'}")

    from eagle_ray.evaluate.check import run_check
    from eagle_ray.evaluate.run import run_evaluate
    from eagle_ray.export.drafter import export_drafter

    t0 = time.time()
    drafter = export_drafter(out / "train", out / "drafter")
    chk = run_check(recipe, drafter, out / "store")
    if not chk.ok:
        raise ValueError("check failed: " + "; ".join(chk.problems))
    print(f"export + check: {drafter} loads in vLLM and receives the trained features "
          f"(max |diff| {chk.details['max_abs_diff']:.3g} over {chk.details['tokens_compared']} tokens)")
    ev = run_evaluate(recipe, drafter, out / "ingest", out / "evaluate")
    timings["export_check_evaluate"] = time.time() - t0
    print(f"evaluate: mean acceptance length offline {ev['offline']['mean_acceptance_length']:.2f}, "
          f"online {ev['online']['mean_acceptance_length']:.2f}, untrained "
          f"{ev['untrained']['mean_acceptance_length']:.2f}, n-gram {ev['ngram']['mean_acceptance_length']:.2f}; "
          f"outputs identical {ev['outputs_identical']} -> {out / 'evaluate' / 'report.md'}")

    summary = {"recipe": recipe.to_dict(), "target_dir": str(target_dir),
               "ingest": {k: getattr(res, k) for k in
                          ("lines_read", "accepted", "duplicates", "rejected", "sampled_out")},
               "stats": stats, "plan": plan.to_dict(),
               "generate": {"generated": gen.generated, "rejected": gen.rejected},
               "generate_stats": gen_stats,
               "extract": {"extracted": ext.extracted, "tokens": ext.tokens},
               "store_verify": check, "train": train, "check": chk.details,
               "evaluate": {k: ev[k] for k in ("offline", "online", "untrained", "ngram",
                                               "outputs_identical")},
               "timings_s": timings}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"summary: {out / 'summary.json'}")
    return summary
