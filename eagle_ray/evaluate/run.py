"""`eagle-ray evaluate`: offline + online acceptance of a drafter, vs untrained and n-gram.

Writes OUT/report.json, OUT/report.md and OUT/acceptance.png. Online runs are real vLLM
speculative decoding on the same held-out prompts (prompts whose sample ids the drafter
was trained on are excluded), greedy, so every speculative run must reproduce the plain
run's tokens exactly (`outputs_identical`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from eagle_ray.config import Recipe
from eagle_ray.targets.resolve import resolve_target_path
from eagle_ray.common.outputs import claim_output_dir
from eagle_ray.common.provenance import atomic_write_bytes, atomic_write_json, provenance

logger = logging.getLogger(__name__)


def run_evaluate(recipe: Recipe, drafter_dir: str | Path, prompts: str | Path, out_dir: str | Path,
                 *, k: int | None = None, limit: int | None = None,
                 seeds: int | None = None) -> dict[str, Any]:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from eagle_ray.vllm.engine import engine_kwargs
    from eagle_ray.evaluate.acceptance import (offline_acceptance, online_run_isolated,
                                               prompts_from_ingest)
    from eagle_ray.export.drafter import export_drafter, read_drafter_config

    out = claim_output_dir(out_dir, "evaluate")  # new, empty or an earlier evaluate output
    drafter_dir = Path(drafter_dir).resolve()
    dcfg = read_drafter_config(drafter_dir)
    run_dir = Path(dcfg.get("eagle_ray", {}).get("run_dir", ""))
    if not (run_dir / "run.json").exists():
        raise ValueError(f"{drafter_dir} does not name its training run (eagle_ray.run_dir); "
                         "export it with `eagle-ray export`")
    info = json.loads((run_dir / "run.json").read_text())
    k = k or recipe.drafter.num_speculative_tokens
    limit = recipe.evaluate.prompts if limit is None else limit
    seeds = recipe.evaluate.seeds if seeds is None else seeds
    model_dir = resolve_target_path(recipe.target)
    from eagle_ray.targets.identity import check_same_target, recorded_target

    check_same_target(recipe, model_dir, recorded_target(info["store_manifest"]),
                      f"the drafter {drafter_dir} (its run {run_dir})")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    held_out = prompts_from_ingest(prompts, tok, limit, exclude_ids=set(info["train_ids"]))
    if not held_out:
        raise ValueError(f"no held-out prompts in {prompts} (all were used for training)")

    # Offline: trained vs untrained on the store's validation split.
    weights = {kname: v for kname, v in load_file(str(drafter_dir / "model.safetensors")).items()}
    # (An online-trained run has no store: no offline figures, the online ones are measured.)
    offline = offline_acceptance(info, weights, k) if info.get("store") else None
    offline_untrained = offline_acceptance(info, None, k) if info.get("store") else None

    # Online: real vLLM, same prompts, greedy.
    ekw = engine_kwargs(recipe, str(model_dir))
    max_tokens = recipe.generate.max_tokens
    untrained_dir = export_drafter(run_dir, out / "untrained_drafter", untrained=True)
    runs: dict[str, Any] = {}
    specs = {"baseline": None,
             "online": {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": k},
             "untrained": {"method": "eagle3", "model": str(untrained_dir), "num_speculative_tokens": k},
             "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2}}
    from eagle_ray.targets.serving import serving_profile

    profile = serving_profile(recipe, model_dir)
    # As served: the same engines also run the prompts at the serving profile, once per seed
    # (vLLM's rejection sampling), and the trained drafter with probabilistic drafting too.
    sampled = ({"sampling": profile, "seeds": list(range(seeds))}
               if profile["temperature"] > 0 and seeds > 0 else None)
    if sampled:
        specs["online_probabilistic"] = {**specs["online"], "draft_sample_method": "probabilistic"}
    for i, (name, spec) in enumerate(specs.items()):
        logger.info("evaluate: online run %d of %d, %s (%d prompts, greedy%s)", i + 1, len(specs),
                    name, len(held_out), f" + {seeds} seed(s) as served" if sampled else "")
        runs[name] = online_run_isolated(ekw, held_out, max_tokens, spec, sampled)
    base = runs["baseline"]["outputs"]
    identical = {name: r["outputs"] == base for name, r in runs.items()
                 if name not in ("baseline", "online_probabilistic")}
    for r in runs.values():
        r.pop("outputs")
    as_served = _as_served(runs, profile, sampled) if sampled else None
    for r in runs.values():
        r.pop("sampled", None)
    runs.pop("online_probabilistic", None)

    report = {
        "k": k, "prompts": len(held_out), "max_tokens": max_tokens,
        "drafter": str(drafter_dir), "target": str(model_dir),
        "metric": "pooled over drafts as vLLM does: 1 + accepted / drafts (not a per-request mean)",
        "offline": offline, "offline_untrained": offline_untrained,
        "online": runs["online"], "untrained": runs["untrained"], "ngram": runs["ngram"],
        "baseline": runs["baseline"],
        "speedup_vs_baseline": {n: runs[n]["tokens_per_s"] / runs["baseline"]["tokens_per_s"]
                                for n in ("online", "untrained", "ngram")},
        "outputs_identical": all(identical.values()), "outputs_identical_by_run": identical,
        "offline_online_gap": (abs(offline["mean_acceptance_length"]
                                   - runs["online"]["mean_acceptance_length"]) if offline else None),
        "serving_profile": profile, "as_served": as_served,
        "provenance": provenance(),
    }
    atomic_write_json(out / "report.json", report)
    atomic_write_bytes(out / "report.md", _markdown(report).encode())
    from eagle_ray.ops.metrics import record

    for name in ("offline", "online", "untrained", "ngram"):
        if report[name]:
            record("eagle_ray_acceptance_length", report[name]["mean_acceptance_length"],
                   stage="evaluate", run=name)
    _plot(report, out / "acceptance.png")
    return report


def as_served_line(report: dict[str, Any]) -> str | None:
    """One line of the as-served figures of a report (None without them)."""
    a = report.get("as_served")
    if not a:
        return None
    return (f"evaluate as served ({', '.join(f'{k} {v}' for k, v in a['sampling'].items())}, "
            f"{len(a['seeds'])} seed(s)): mean acceptance length "
            f"{a['runs']['online']['mean_acceptance_length']:.2f} with greedy drafting, "
            f"{a['runs']['online_probabilistic']['mean_acceptance_length']:.2f} with "
            f"probabilistic, n-gram {a['runs']['ngram']['mean_acceptance_length']:.2f}")


def _as_served(runs: dict[str, Any], profile: dict, sampled: dict) -> dict[str, Any]:
    """Per drafter at the serving profile: acceptance pooled over seeds, its spread over
    seeds, tokens/s and speedup over no speculation, and the drafting method that accepts
    most (what the export recommends)."""
    import statistics

    from eagle_ray.evaluate.acceptance import pooled

    out: dict[str, Any] = {}
    for name, r in runs.items():
        per_seed = r["sampled"]
        row: dict[str, Any] = {"tokens_per_s": statistics.fmean(s["tokens_per_s"] for s in per_seed),
                               "output_tokens": sum(s["output_tokens"] for s in per_seed)}
        if "num_drafts" in per_seed[0]:
            drafts = sum(s["num_drafts"] for s in per_seed)
            acc = [sum(s["accepted_per_pos"][j] for s in per_seed)
                   for j in range(len(per_seed[0]["accepted_per_pos"]))]
            means = [s["mean_acceptance_length"] for s in per_seed]
            row |= pooled(drafts, acc) | {
                "per_seed": means, "spread": (max(means) - min(means)),
                "std": statistics.stdev(means) if len(means) > 1 else 0.0}
        out[name] = row
    base = out["baseline"]["tokens_per_s"]
    for name, row in out.items():
        row["speedup_vs_baseline"] = row["tokens_per_s"] / base
    methods = {"greedy": out["online"]["mean_acceptance_length"],
               "probabilistic": out["online_probabilistic"]["mean_acceptance_length"]}
    return {"sampling": {k: profile[k] for k in ("temperature", "top_p", "top_k", "min_p")},
            "seeds": sampled["seeds"], "runs": out,
            "draft_sample_method": methods,
            "recommended_draft_sample_method": max(methods, key=methods.get)}


def _markdown(r: dict) -> str:
    rows = [("offline (store, simulated)", r["offline"], None),
            ("offline, untrained drafter", r["offline_untrained"], None),
            ("online EAGLE-3 (vLLM)", r["online"], r["online"]["tokens_per_s"]),
            ("online untrained drafter", r["untrained"], r["untrained"]["tokens_per_s"]),
            ("online n-gram", r["ngram"], r["ngram"]["tokens_per_s"]),
            ("no speculation", None, r["baseline"]["tokens_per_s"])]
    k = r["k"]
    head = ("| run | mean acceptance length | " + " | ".join(f"pos {j}" for j in range(k))
            + " | output tok/s |\n|---|---|" + "---|" * k + "---|\n")
    body = ""
    for name, m, tps in rows:
        pos = " | ".join(f"{p:.3f}" for p in m["per_position_acceptance"]) if m else " | ".join("-" * 1 for _ in range(k))
        body += (f"| {name} | {m['mean_acceptance_length']:.3f} | " if m else f"| {name} | - | ") + pos + \
                (f" | {tps:,.0f} |\n" if tps else " | - |\n")
    served = ""
    if r.get("as_served"):
        s = r["as_served"]
        samp = ", ".join(f"{key} {val}" for key, val in s["sampling"].items())
        served = (f"\n## As served ({samp}; {len(s['seeds'])} seed(s))\n\n"
                  "| run | mean acceptance length | spread over seeds | "
                  + " | ".join(f"pos {j}" for j in range(k)) + " | output tok/s | speedup |\n"
                  "|---|---|---|" + "---|" * k + "---|---|\n")
        names = {"online": "EAGLE-3, greedy drafting", "online_probabilistic":
                 "EAGLE-3, probabilistic drafting", "untrained": "untrained drafter",
                 "ngram": "n-gram", "baseline": "no speculation"}
        for key, label in names.items():
            m = s["runs"][key]
            if "mean_acceptance_length" in m:
                served += (f"| {label} | {m['mean_acceptance_length']:.3f} | {m['spread']:.3f} | "
                           + " | ".join(f"{p:.3f}" for p in m["per_position_acceptance"]))
            else:
                served += f"| {label} | - | - | " + " | ".join("-" for _ in range(k))
            served += f" | {m['tokens_per_s']:,.0f} | {m['speedup_vs_baseline']:.2f}x |\n"
        served += (f"\nRecommended draft_sample_method: {s['recommended_draft_sample_method']} "
                   "(mean acceptance length: " + ", ".join(
                       f"{m} {a:.3f}" for m, a in s["draft_sample_method"].items())
                   + "). Speedups are measured "
                   "on this machine (the tiny CPU target: a drafter step costs about a target "
                   "step there, so they say little about a large target on GPUs).\n")
    return (f"# Drafter evaluation\n\n{r['prompts']} held-out prompts, k = {k}, greedy, "
            f"max_tokens {r['max_tokens']}. Acceptance is {r['metric']}.\n\n{head}{body}\n"
            f"Outputs with speculation identical to without: {r['outputs_identical']}.\n"
            + (f"Offline vs online mean acceptance length gap: {r['offline_online_gap']:.3f}.\n"
               if r["offline_online_gap"] is not None else
               "Offline figures: none (the drafter was trained online, without a store).\n")
            + served)


def _plot(r: dict, path: Path) -> None:
    """Render in a child process: importing matplotlib here breaks every later vLLM engine
    in this process (vLLM 0.32's CPU kernel-override scan trips over one of its objects)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "eagle_ray.evaluate.plot", str(path.parent / "report.json"),
                    str(path)], check=True, timeout=120)
