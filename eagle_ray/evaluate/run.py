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
                 *, k: int | None = None, limit: int = 64) -> dict[str, Any]:
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
    model_dir = resolve_target_path(recipe.target)
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
    for name, spec in specs.items():
        logger.info("evaluate: online run %s (%d prompts)", name, len(held_out))
        runs[name] = online_run_isolated(ekw, held_out, max_tokens, spec)
    base = runs["baseline"]["outputs"]
    identical = {name: r["outputs"] == base for name, r in runs.items() if name != "baseline"}
    for r in runs.values():
        r.pop("outputs")

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
    return (f"# Drafter evaluation\n\n{r['prompts']} held-out prompts, k = {k}, greedy, "
            f"max_tokens {r['max_tokens']}. Acceptance is {r['metric']}.\n\n{head}{body}\n"
            f"Outputs with speculation identical to without: {r['outputs_identical']}.\n"
            + (f"Offline vs online mean acceptance length gap: {r['offline_online_gap']:.3f}.\n"
               if r["offline_online_gap"] is not None else
               "Offline figures: none (the drafter was trained online, without a store).\n"))


def _plot(r: dict, path: Path) -> None:
    """Render in a child process: importing matplotlib here breaks every later vLLM engine
    in this process (vLLM 0.32's CPU kernel-override scan trips over one of its objects)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "eagle_ray.evaluate.plot", str(path.parent / "report.json"),
                    str(path)], check=True, timeout=120)
