"""The end-to-end pipeline, step by step (the job in jobs/end_to_end.py calls this).

    target -> ingest -> stats/plan -> generate+extract -> train -> export -> check -> evaluate
    OUT/    ingest/              generate/   store/    train/  drafter/ check.json evaluate/

Each step writes under OUT/ with the same code as its CLI command, and is skipped when its
output is already complete, so a failed or stopped job resumes when it is submitted again:

  step      complete when                                          when not complete
  ingest    ingest/report.json (written last)                      re-run (deterministic ids)
  generate  generate/manifest.json: no prompt pending              resume: skip done samples
  extract   every conversation committed in store/index            resume: skip committed samples
            (generate and extract stream in one Ray Data pipeline, eagle_ray/stream/separate.py:
            separate pools, or one colocated engine per replica for whole-node targets)
  train     newest loadable checkpoint at train.max_steps          resume from that checkpoint
  export    drafter/ exported from that checkpoint                 export (atomic swap)
  check     check.json (ok) for that drafter                       check
  evaluate  evaluate/report.json for that drafter                  evaluate
  (stats and plan are recomputed every time: seconds.)

A different recipe or data set needs a new --out: generate and the store refuse mixing.
OUT/summary.json (status "finished") is written last.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from eagle_ray.config import Recipe
from eagle_ray.targets.resolve import resolve_target_path
from eagle_ray.common.atomic import atomic_write_json

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE_DATA = [str(REPO_ROOT / "examples" / "data" / "personal.jsonl"),
               str(REPO_ROOT / "examples" / "data" / "general_sharegpt.jsonl") + ":600::general"]
SUMMARY_FILE = "summary.json"
CHECK_FILE = "check.json"


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def train_complete(run_dir: Path, max_steps: int) -> Path | None:
    """The final checkpoint when training reached max_steps, else None."""
    from eagle_ray.train.checkpoint import newest_loadable

    if not (run_dir / "run.json").exists():
        return None
    ckpt = newest_loadable(run_dir)
    if ckpt is None or json.loads((ckpt / "state.json").read_text())["step"] < max_steps:
        return None
    return ckpt


def _last_metrics(run_dir: Path) -> dict:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    return json.loads(lines[-1]) if lines else {}


def _skip(step: str, where: Path) -> None:
    print(f"{step}: complete in {where}, skipped")


def run_end_to_end(recipe: Recipe, inputs: list[str], out_dir: str | Path, *,
                   online: bool = False) -> dict:
    """The steps above. `online`: no store: generate, then train with features streamed from
    extractor actors (train/online.py); check captures its reference features again."""
    from eagle_ray.data.ingest import SourceSpec, ingest
    from eagle_ray.data.stats import compute_stats, format_stats, token_lengths
    from eagle_ray.data.tokenize import length_annotator
    from eagle_ray.plan.budget import format_plan, plan_from_stats

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    ran: list[str] = []

    t0 = time.time()
    target_dir = resolve_target_path(recipe.target)
    timings["target"] = time.time() - t0
    logger.info("target: %s", target_dir)

    t0 = time.time()
    report = _json(out / "ingest" / "report.json")
    if report is None:
        ingest([SourceSpec.parse(s) for s in inputs], out / "ingest", seed=recipe.data.seed,
               annotate=length_annotator(recipe))
        report = _json(out / "ingest" / "report.json")
        ran.append("ingest")
    else:
        _skip("ingest", out / "ingest")
    timings["ingest"] = time.time() - t0
    counts = {k: report[k] for k in ("lines_read", "accepted", "duplicates", "rejected", "sampled_out")}
    print(f"ingest: accepted {counts['accepted']:,} + duplicates {counts['duplicates']:,} + rejected "
          f"{counts['rejected']:,} + sampled out {counts['sampled_out']:,} = lines read "
          f"{counts['lines_read']:,}")
    if counts["accepted"] == 0:
        raise ValueError("no sample was accepted; see " + str(out / "ingest" / "rejects.jsonl"))

    stats = compute_stats(out / "ingest")
    print(format_stats(stats))
    plan = plan_from_stats(recipe, stats, token_lengths(out / "ingest").to_numpy(),
                           out_dir=out / "store")
    print(format_plan(plan))

    from eagle_ray.store.reader import committed_ids, verify_store
    from eagle_ray.stream.separate import run_generate_extract

    t0 = time.time()
    if online:
        from eagle_ray.generate.run import run_generate

        if (out / "store").exists():
            raise ValueError(f"{out} holds a store from an offline run; use a new --out for --online")
        g = run_generate(recipe, out / "ingest", out / "generate")
        n_gen = g.prompts - g.skipped_done  # this run's work (0 on a resubmitted job)
        n_ext = n_tok = before = 0
        mode = "generate only: online training extracts as it trains"
        check = {"ok": True, "samples": 0, "shards": 0, "problems": [], "online": True}
        if n_gen:
            ran.append("generate")
    else:
        before = len(committed_ids(out / "store")) if (out / "store" / "manifest.json").exists() else 0
        # Streamed: one Ray Data pipeline; separate generation and extractor pools, or one
        # colocated engine per replica for a target that takes the whole node (the recipe's
        # extract.placement). Both resume per sample and start no Ray work when nothing is left.
        st = run_generate_extract(recipe, out / "ingest", out / "generate", out / "store")
        n_gen, n_ext, n_tok = st.generated, st.extracted, st.tokens
        mode = f"streamed, {recipe.extract.placement}"
        check = verify_store(out / "store")
        if n_gen or n_ext:
            ran.append("generate+extract")
    # One wall time for both steps when streamed.
    timings["generate"] = timings["extract"] = timings["generate_extract"] = time.time() - t0
    gen_counts = (_json(out / "generate" / "manifest.json") or {}).get("counts", {})
    if not (n_gen or n_ext):
        _skip("generate", out / "generate")
        if not online:
            _skip("extract", out / "store")
    store_line = ("no store (online)" if online else
                  f"store verify: {check['samples']:,} samples in {check['shards']:,} shards, "
                  f"{'OK' if check['ok'] else 'PROBLEMS: ' + str((check['problems'] + check['orphans'])[:3])}")
    print(f"generate+extract ({mode}): {n_gen:,} prompts generated, {n_ext:,} samples "
          f"({n_tok:,} tokens) extracted this run ({before:,} already in the store); "
          f"{gen_counts.get('ok', 0):,} conversations, {gen_counts.get('rejected', 0):,} rejected "
          f"-> {out / 'generate'}; {store_line}")
    gen_stats = compute_stats(out / "generate")
    print(format_stats(gen_stats))

    from eagle_ray.train.run import run_train

    t0 = time.time()
    if not ran and train_complete(out / "train", recipe.train.max_steps) is not None:
        _skip("train", out / "train")
        train = _last_metrics(out / "train")
    else:
        train = (run_train(recipe, None, out / "train", conversations=out / "generate") if online
                 else run_train(recipe, out / "store", out / "train"))
        ran.append("train")
    timings["train"] = time.time() - t0
    print(f"train: step {train.get('step')}, held-out step-0 accuracy "
          f"{train.get('val/acc_step0', float('nan')):.3f}, step-1 "
          f"{train.get('val/acc_step1', float('nan')):.3f} -> {out / 'train'}")

    from eagle_ray.evaluate.check import run_check
    from eagle_ray.evaluate.run import run_evaluate
    from eagle_ray.export.drafter import export_drafter

    t0 = time.time()
    drafter = out / "drafter"
    if not ran and (drafter / "config.json").exists():
        _skip("export", drafter)
    else:
        drafter = export_drafter(out / "train", drafter)
        ran.append("export")
    chk_details = (_json(out / CHECK_FILE) or {}) if not ran else {}
    if chk_details.get("ok"):
        _skip("check", out / CHECK_FILE)
    else:
        chk = run_check(recipe, drafter, None if online else out / "store")
        if not chk.ok:
            raise ValueError("check failed: " + "; ".join(chk.problems))
        chk_details = {"ok": True, **chk.details}
        atomic_write_json(out / CHECK_FILE, chk_details)
        ran.append("check")
    print(f"export + check: {drafter} loads in vLLM and receives the trained features "
          f"(max |diff| {chk_details['max_abs_diff']:.3g} over {chk_details['tokens_compared']} tokens)")
    ev = _json(out / "evaluate" / "report.json") if not ran else None
    if ev is not None:
        _skip("evaluate", out / "evaluate")
    else:
        # A run started from a published drafter is judged against it too.
        ev = run_evaluate(recipe, drafter, out / "ingest", out / "evaluate",
                          baseline_drafter=recipe.train.init_from or None)
        ran.append("evaluate")
    if "measured" not in (_json(drafter / "serving.json") or {}):
        # serving.json recommends what evaluate measured best at the serving profile.
        drafter = export_drafter(out / "train", drafter, evaluation=out / "evaluate" / "report.json")
    timings["export_check_evaluate"] = time.time() - t0
    from eagle_ray.evaluate.run import problems, summary_lines

    print("\n".join(summary_lines(ev, out / "evaluate")))
    for p in problems(ev):  # the same judgement `eagle-ray evaluate` exits 1 on
        print(f"evaluate: problem: {p}; see {out / 'evaluate' / 'report.md'}", file=sys.stderr)

    summary = {"status": "finished", "steps_run": ran,
               "recipe": recipe.to_dict(), "target_dir": str(target_dir),
               "ingest": counts, "stats": stats, "plan": plan.to_dict(),
               "generate": {"generated": gen_counts.get("ok"), "rejected": gen_counts.get("rejected"),
                            "pending": gen_counts.get("pending")},
               "generate_stats": gen_stats,
               # this run's work (0 when the store was already complete) and the store's size
               "extract": {"extracted": n_ext, "tokens": n_tok,
                           "samples": check["samples"]},
               "store_verify": check, "train": train, "check": chk_details,
               "evaluate": {k: ev.get(k) for k in ("headline", "offline", "online", "untrained", "ngram",
                                                   "baseline_drafter", "outputs_identical", "as_served")},
               "timings_s": timings}
    atomic_write_json(out / SUMMARY_FILE, json.loads(json.dumps(summary, default=str)))
    print(summary_text(out, timings, ran))
    return summary


def summary_text(out: Path, timings: dict[str, float], ran: list[str]) -> str:
    """The job's last lines: wall time per step, the headline, where every output is."""
    from eagle_ray.common.progress import hms

    steps = [("ingest", "ingest"), ("generate+extract", "generate_extract"), ("train", "train"),
             ("export+check+evaluate", "export_check_evaluate")]
    ev = _json(out / "evaluate" / "report.json") or {}
    lines = ["", "summary",
             "  wall time: " + ", ".join(f"{name} {hms(timings[k])}" for name, k in steps if k in timings)
             + f" (steps run this time: {', '.join(ran) or 'none'})"]
    if ev.get("headline"):
        lines.append(f"  headline: {_headline_text(ev)}")
    outputs = [("ingested prompts", out / "ingest"), ("conversations", out / "generate"),
               ("hidden-state store", out / "store"), ("training run", out / "train"),
               ("drafter (vLLM loads it; serving.json: the serve command)", out / "drafter"),
               ("evaluation", out / "evaluate" / "report.md"), ("logs (everything)", out / "logs"),
               ("summary", out / SUMMARY_FILE)]
    lines += [f"  {what}: {where}" for what, where in outputs if where.exists()]
    return "\n".join(lines)


def _headline_text(ev: dict) -> str:
    h = ev["headline"]
    return (f"expected speedup {h['setting']} {h['speedup']:.2f}x with {h['draft_sample_method']} "
            f"drafting, mean acceptance length {h['mean_acceptance_length']:.2f}")
