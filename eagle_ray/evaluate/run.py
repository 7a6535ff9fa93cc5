"""`eagle-ray evaluate`: what the user will get from a drafter, offline and online, vs the
untrained drafter, n-gram and optionally a baseline drafter (e.g. the published one a run
started from), pooled and per ingest source.

Writes OUT/report.json, OUT/report.md and OUT/acceptance.png. Online runs are real vLLM
speculative decoding on the same held-out prompts (prompts whose samples the drafter was
trained on are excluded). Greedy: every speculative run must reproduce the plain run's tokens
exactly (`outputs_identical`). At the serving profile (temperature > 0), once per seed, with
vLLM's rejection sampling: mean and spread over seeds, greedy and probabilistic drafting,
speedup over no speculation (the report's headline), a distribution test (speculation must
leave the output distribution unchanged, `served.distribution_tests`) and the acceptance
expected offline from the store (`served`), which must agree with the online figure.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from eagle_ray.config import Recipe
from eagle_ray.targets.resolve import resolve_target_path
from eagle_ray.common.outputs import claim_output_dir
from eagle_ray.common.atomic import atomic_write_bytes, atomic_write_json
from eagle_ray.common.provenance import provenance

# Offline (expected, exact in expectation) and online mean acceptance lengths as served agree
# when the gap is within this many standard errors of the two figures' sampling noise, or
# within MIN_OFFLINE_ONLINE_GAP (what a bias of a few percent, such as max_tokens cutting
# online drafts short, can make). A wider gap means a broken sampler or other features.
OFFLINE_ONLINE_SIGMAS = 4.0
MIN_OFFLINE_ONLINE_GAP = 0.25

logger = logging.getLogger(__name__)


def run_evaluate(recipe: Recipe, drafter_dir: str | Path, prompts: str | Path, out_dir: str | Path,
                 *, k: int | None = None, limit: int | None = None, seeds: int | None = None,
                 baseline_drafter: str | Path | None = None) -> dict[str, Any]:
    from eagle_ray.data.tokenize import load_tokenizer

    from eagle_ray.vllm.engine import engine_kwargs
    from eagle_ray.evaluate.acceptance import prompts_from_ingest

    out = claim_output_dir(out_dir, "evaluate")  # new, empty or an earlier evaluate output
    drafter_dir = Path(drafter_dir).resolve()
    run_dir, info = _training_run(drafter_dir)
    k = k or recipe.drafter.num_speculative_tokens
    limit = recipe.evaluate.prompts if limit is None else limit
    seeds = recipe.evaluate.seeds if seeds is None else seeds
    model_dir = resolve_target_path(recipe.target)
    from eagle_ray.targets.identity import check_same_target, recorded_target

    check_same_target(recipe, model_dir, recorded_target(info["store_manifest"]),
                      f"the drafter {drafter_dir} (its run {run_dir})")
    if baseline_drafter is not None:
        baseline_drafter = _check_baseline_drafter(Path(baseline_drafter).resolve(), model_dir)
    tok = load_tokenizer(recipe.target)
    skipped: dict[str, int] = {}
    held_out, sources = prompts_from_ingest(prompts, tok, limit, exclude_ids=set(info["train_ids"]),
                                            with_sources=True, skipped=skipped,
                                            max_prompt_tokens=held_out_limit(recipe))
    if not held_out:
        raise ValueError(f"no held-out prompts in {prompts} (all were used for training"
                         + (f", or {skipped['too_long']} too long for engine.max_model_len="
                            f"{recipe.engine.max_model_len} with generate.max_tokens="
                            f"{recipe.generate.max_tokens}" if skipped else "") + ")")
    if skipped:
        logger.info("evaluate: %d held-out prompt(s) skipped: longer than engine.max_model_len=%d "
                 "less generate.max_tokens=%d", skipped["too_long"], recipe.engine.max_model_len,
                 recipe.generate.max_tokens)
    from eagle_ray.targets.serving import serving_profile

    profile = serving_profile(recipe, model_dir)
    served = profile["temperature"] > 0 and seeds > 0

    # Offline: trained vs untrained on the store's validation split, greedy and (expected)
    # as served. (An online-trained run has no store: no offline figures.)
    offline, offline_untrained = _offline(info, drafter_dir, k, profile if served else None,
                                          _tool_call_mask(recipe, tok))

    # Online: real vLLM, same prompts, greedy, then once per seed as served.
    ekw = engine_kwargs(recipe, str(model_dir))
    max_tokens = recipe.generate.max_tokens
    specs, sampled = _online_specs(run_dir, out, drafter_dir, baseline_drafter, k, profile, seeds, served)
    runs = _online_runs(ekw, held_out, max_tokens, specs, sampled, sources, seeds)
    identical, as_served = _compare_outputs(runs, profile, sampled, offline)
    report = _report(runs, identical, as_served, k=k, held_out=held_out, sources=sources,
                     max_tokens=max_tokens, drafter_dir=drafter_dir, model_dir=model_dir,
                     baseline_drafter=baseline_drafter, offline=offline,
                     offline_untrained=offline_untrained, profile=profile)
    report["prompts_skipped_too_long"] = skipped.get("too_long", 0)
    _write_outputs(report, out)
    return report


def _training_run(drafter_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The training run an exported drafter names (its directory and run.json), else refuse."""
    from eagle_ray.export.drafter import read_drafter_config

    dcfg = read_drafter_config(drafter_dir)
    run_dir = Path(dcfg.get("eagle_ray", {}).get("run_dir", ""))
    if not (run_dir / "run.json").exists():
        raise ValueError(f"{drafter_dir} does not name its training run (eagle_ray.run_dir); "
                         "export it with `eagle-ray export`")
    info = json.loads((run_dir / "run.json").read_text())
    return run_dir, info


def held_out_limit(recipe: Recipe) -> int | None:
    """The longest held-out prompt the online runs take: the engine's context less the tokens
    each request generates (None: the model's own context, not known here)."""
    m = recipe.engine.max_model_len
    return None if m is None else max(1, m - recipe.generate.max_tokens)


def _tool_call_mask(recipe: Recipe, tokenizer):
    """Token ids -> inside a tool-call section, per token, by the markers of the recipe's
    tool-call parser (None where it names none)."""
    from eagle_ray.evaluate.acceptance import TOOL_CALL_MARKERS, tool_call_tokens

    markers = TOOL_CALL_MARKERS.get(recipe.serve.tool_call_parser or "")
    return (lambda ids: tool_call_tokens(tokenizer, ids, markers)) if markers else None


def _offline(info: dict[str, Any], drafter_dir: Path, k: int, sampling: dict | None,
             tool_call_mask=None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Offline acceptance of the trained and the untrained drafter (None for both without a
    store); the trained one also by turn kind given a `tool_call_mask` and as served given
    `sampling`, the untrained one greedy only (the report's greedy table is where it shows;
    as served it cost SmolLM2's demo 16 s more for a row no one reads)."""
    from safetensors.torch import load_file

    from eagle_ray.evaluate.acceptance import offline_acceptance

    weights = {kname: v for kname, v in load_file(str(drafter_dir / "model.safetensors")).items()}
    offline = offline_acceptance(info, weights, k, sampling=sampling,
                                 tool_call_mask=tool_call_mask) if info.get("store") else None
    offline_untrained = offline_acceptance(info, None, k) if info.get("store") else None
    return offline, offline_untrained


def _online_specs(run_dir: Path, out: Path, drafter_dir: Path, baseline_drafter: Path | None, k: int,
                  profile: dict, seeds: int, served: bool) -> tuple[dict[str, Any], dict | None]:
    """Export the untrained drafter; the speculative configs of the online runs, and what to sample."""
    from eagle_ray.export.drafter import export_drafter

    untrained_dir = export_drafter(run_dir, out / "untrained_drafter", untrained=True)
    eagle = {"method": "eagle3", "num_speculative_tokens": k}
    specs: dict[str, Any] = {"baseline": None,
                             "online": {**eagle, "model": str(drafter_dir)},
                             "untrained": {**eagle, "model": str(untrained_dir)},
                             "ngram": {"method": "ngram", "num_speculative_tokens": k,
                                       "prompt_lookup_max": 4, "prompt_lookup_min": 2}}
    if baseline_drafter is not None:
        specs["baseline_drafter"] = {**eagle, "model": str(baseline_drafter)}
    sampled = {"sampling": profile, "seeds": list(range(seeds))} if served else None
    if sampled:
        specs["online_probabilistic"] = {**specs["online"], "draft_sample_method": "probabilistic"}
    return specs, sampled


def _online_runs(ekw: dict[str, Any], held_out: list, max_tokens: int, specs: dict[str, Any],
                 sampled: dict | None, sources: list, seeds: int) -> dict[str, Any]:
    """Every online run in vLLM, one after another, logging each start with an ETA."""
    import time

    from eagle_ray.common.progress import hms
    from eagle_ray.evaluate.acceptance import online_runs_isolated

    t_runs = time.monotonic()

    def starting(i: int, name: str) -> None:
        eta = (f", ETA {hms((time.monotonic() - t_runs) / i * (len(specs) - i))}" if i else "")
        logger.info("evaluate: online run %d of %d, %s (%d prompts, greedy%s)%s", i + 1, len(specs),
                    name, len(held_out), f" + {seeds} seed(s) as served" if sampled else "", eta)

    return online_runs_isolated(ekw, held_out, max_tokens, specs, sampled, sources, starting)


def _compare_outputs(runs: dict[str, Any], profile: dict, sampled: dict | None,
                     offline: dict[str, Any] | None) -> tuple[dict[str, bool], dict[str, Any] | None]:
    """Greedy outputs identical to the plain run's, per run, and the as-served figures; strips
    the runs of their outputs and per-seed results (and drops online_probabilistic)."""
    base = runs["baseline"]["outputs"]
    greedy_names = [n for n in runs if n not in ("baseline", "online_probabilistic")]
    identical = {name: runs[name]["outputs"] == base for name in greedy_names}
    for r in runs.values():
        r.pop("outputs")
    as_served = _as_served(runs, profile, sampled, offline) if sampled else None
    for r in runs.values():
        r.pop("sampled", None)
    runs.pop("online_probabilistic", None)
    return identical, as_served


def _report(runs: dict[str, Any], identical: dict[str, bool], as_served: dict[str, Any] | None, *,
            k: int, held_out: list, sources: list, max_tokens: int, drafter_dir: Path, model_dir: Path,
            baseline_drafter: Path | None, offline: dict[str, Any] | None,
            offline_untrained: dict[str, Any] | None, profile: dict) -> dict[str, Any]:
    """The report (report.json's content) from the offline figures and the online runs."""
    speedups = {n: runs[n]["tokens_per_s"] / runs["baseline"]["tokens_per_s"]
                for n in runs if n != "baseline"}
    return {
        "k": k, "prompts": len(held_out), "max_tokens": max_tokens,
        "sources": {s: sources.count(s) for s in sorted(set(sources))},
        "drafter": str(drafter_dir), "target": str(model_dir),
        "baseline_drafter_dir": str(baseline_drafter) if baseline_drafter is not None else None,
        "metric": "pooled over drafts as vLLM does: 1 + accepted / drafts (not a per-request mean)",
        "offline": offline, "offline_untrained": offline_untrained,
        **{n: runs[n] for n in runs},
        "speedup_vs_baseline": speedups,
        "outputs_identical": all(identical.values()), "outputs_identical_by_run": identical,
        "offline_online_gap": (abs(offline["mean_acceptance_length"]
                                   - runs["online"]["mean_acceptance_length"]) if offline else None),
        "serving_profile": profile, "as_served": as_served,
        "headline": _headline(runs, as_served),
        "device": _device(),
        "provenance": provenance(),
    }


def _write_outputs(report: dict[str, Any], out: Path) -> None:
    """Write report.json and report.md, record the acceptance metrics, then plot acceptance.png."""
    atomic_write_json(out / "report.json", report)
    atomic_write_bytes(out / "report.md", _markdown(report).encode())
    from eagle_ray.ops.metrics import record

    for name in ("offline", "online", "untrained", "ngram"):
        if report[name]:
            record("eagle_ray_acceptance_length", report[name]["mean_acceptance_length"],
                   stage="evaluate", run=name)
    _plot(report, out / "acceptance.png")


def _check_baseline_drafter(path: Path, model_dir: Path) -> Path:
    """A drafter directory for this target (config.json with the target's hidden size and
    vocabulary), else refuse naming both sides."""
    from eagle_ray.export.drafter import read_drafter_config

    cfg = read_drafter_config(path)
    if not (path / "model.safetensors").exists() and not list(path.glob("*.safetensors")):
        raise FileNotFoundError(f"baseline drafter {path} has no safetensors weights")
    tcfg = json.loads((model_dir / "config.json").read_text())
    tcfg = tcfg.get("text_config", tcfg)
    for key in ("hidden_size", "vocab_size"):
        want, got = tcfg.get(key), cfg.get(key)
        if got is not None and want is not None and int(got) != int(want):
            raise ValueError(f"baseline drafter {path} has {key} {got}, the target {model_dir} "
                             f"has {want}: it was trained for another target")
    return path


def _device() -> str:
    import torch

    return (f"GPU ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available()
            else "CPU (with a small target on a CPU, drafting costs about as much as a target "
                 "step, so speedups here say little about a large target on GPUs)")


def speedup_text(h: dict[str, Any]) -> str:
    """A headline's speedup as a person should read it. A drafted run emits at most its mean
    acceptance length in tokens per target step, so it cannot beat the run without drafts by
    more than that: a measured speedup above it says the timings were disturbed (the machine
    busy with other work during one run), not that the drafter is better, and is not shown
    as a speedup."""
    if h["speedup"] > h["mean_acceptance_length"]:
        return (f"not measured (timing disturbed: {h['speedup']:.2f}x is more than acceptance "
                f"length {h['mean_acceptance_length']:.2f} allows; was the machine busy?)")
    return f"{h['speedup']:.2f}x"


def _headline(runs: dict[str, Any], as_served: dict[str, Any] | None) -> dict[str, Any]:
    """The figure the user will see: speedup at the serving profile with the recommended
    drafting method (greedy decoding's when the profile is greedy)."""
    if as_served:
        method = as_served["recommended_draft_sample_method"]
        run = "online_probabilistic" if method == "probabilistic" else "online"
        r = as_served["runs"][run]
        return {"setting": "as served", "draft_sample_method": method,
                "speedup": r["speedup_vs_baseline"], "mean_acceptance_length": r["mean_acceptance_length"],
                "per_position_acceptance": r["per_position_acceptance"]}
    r = runs["online"]
    return {"setting": "greedy", "draft_sample_method": "greedy",
            "speedup": r["tokens_per_s"] / runs["baseline"]["tokens_per_s"],
            "mean_acceptance_length": r["mean_acceptance_length"],
            "per_position_acceptance": r["per_position_acceptance"]}


def summary_lines(report: dict[str, Any], where: str | Path) -> list[str]:
    """What a person reads of an evaluation (the CLI and the job print these): acceptance
    greedy (offline only for a drafter trained from a store), then the as-served line."""
    offline = report.get("offline")
    off = (f"{offline['mean_acceptance_length']:.3f}" if offline
           else "none (trained online, without a store)")
    lines = [f"evaluate: mean acceptance length offline {off}, online "
             f"{report['online']['mean_acceptance_length']:.3f}, untrained "
             f"{report['untrained']['mean_acceptance_length']:.3f}, n-gram "
             f"{report['ngram']['mean_acceptance_length']:.3f}; outputs identical: "
             f"{report['outputs_identical']} -> {Path(where) / 'report.md'}"]
    served = as_served_line(report)
    return lines + ([served] if served else [])


def problems(report: dict[str, Any]) -> list[str]:
    """What makes an evaluation a failure: speculation changed greedy outputs or the output
    distribution as served, or online acceptance is not what the store predicts exactly."""
    served = report.get("as_served") or {}
    out = [] if report["outputs_identical"] else ["greedy outputs with speculation differ from without"]
    if served and not served["distribution_test"]["passed"]:
        out.append("speculation changed the output distribution at the serving profile (distribution test)")
    if served.get("offline_online_agree") is False:
        out.append("online acceptance as served is not what the store predicts (gap "
                   f"{served['offline_online_gap_max']:.2f}, beyond the noise): the serving path "
                   "verifies drafts otherwise or feeds the drafter other features")
    return out


def as_served_line(report: dict[str, Any]) -> str | None:
    """One line of the as-served figures of a report (None without them)."""
    a = report.get("as_served")
    if not a:
        return None
    h = report["headline"]
    dist = a["distribution_test"]
    return (f"evaluate as served ({', '.join(f'{k} {v}' for k, v in a['sampling'].items())}, "
            f"{len(a['seeds'])} seed(s)): speedup {speedup_text(h)} with "
            f"{h['draft_sample_method']} drafting (recommended); mean acceptance length "
            f"{a['runs']['online']['mean_acceptance_length']:.2f} greedy drafting, "
            f"{a['runs']['online_probabilistic']['mean_acceptance_length']:.2f} probabilistic, "
            f"n-gram {a['runs']['ngram']['mean_acceptance_length']:.2f}; output distribution "
            + ("unchanged" if dist["passed"] else "CHANGED (distribution test failed)")
            + (f"; offline-online gap {a['offline_online_gap_max']:.2f}"
               if a.get("offline_online_gap_max") is not None else ""))


def _as_served(runs: dict[str, Any], profile: dict, sampled: dict,
               offline: dict[str, Any] | None) -> dict[str, Any]:
    """Per drafter at the serving profile: acceptance pooled over seeds (and per source), its
    spread over seeds, tokens/s and speedup over no speculation, the distribution test, the
    offline expectation and its gap to online, and the drafting method that accepts most
    (what the export recommends)."""
    import statistics

    from eagle_ray.evaluate.acceptance import pooled
    from eagle_ray.evaluate.served import distribution_tests

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
            if "per_source" in per_seed[0]:
                row["per_source"] = {
                    src: pooled(sum(s["per_source"][src]["num_drafts"] for s in per_seed),
                                [sum(s["per_source"][src]["accepted_per_pos"][j] for s in per_seed)
                                 for j in range(len(per_seed[0]["per_source"][src]["accepted_per_pos"]))])
                    for src in per_seed[0]["per_source"]}
        out[name] = row
    base = out["baseline"]["tokens_per_s"]
    for name, row in out.items():
        row["speedup_vs_baseline"] = row["tokens_per_s"] / base
    methods = {"greedy": out["online"]["mean_acceptance_length"],
               "probabilistic": out["online_probabilistic"]["mean_acceptance_length"]}
    plain = [s["outputs"] for s in runs["baseline"]["sampled"]]
    dist = distribution_tests(plain, {n: [s["outputs"] for s in r["sampled"]]
                                      for n, r in runs.items() if n != "baseline"})
    result = {"sampling": {k: profile[k] for k in ("temperature", "top_p", "top_k", "min_p")},
              "seeds": sampled["seeds"], "runs": out,
              "draft_sample_method": methods,
              "recommended_draft_sample_method": max(methods, key=methods.get),
              "distribution_test": dist}
    if offline and offline.get("as_served"):
        result |= offline_online_agreement(offline["as_served"], methods, len(plain[0]))
    return result


def offline_online_agreement(offline_served: dict[str, Any], online: dict[str, float],
                             online_prompts: int) -> dict[str, Any]:
    """Offline expectation vs online mean acceptance length as served, per drafting method.
    Judged only where the expectation is exact (`offline_acceptance`: a store sampled at the
    serving profile); the tolerance is OFFLINE_ONLINE_SIGMAS standard errors of the
    difference, the online one estimated from the store's per-sample spread at the online
    prompt count (each online prompt is one more conversation like the stored ones; seeds
    only reduce the noise within a prompt), and never below MIN_OFFLINE_ONLINE_GAP."""
    names = {"greedy": "greedy_drafting", "probabilistic": "probabilistic_drafting"}
    expected = {m: offline_served[key]["mean_acceptance_length"] for m, key in names.items()}
    gaps = {m: abs(expected[m] - online[m]) for m in names}
    out: dict[str, Any] = {"offline_expected": expected, "offline_online_gap": gaps,
                           "offline_online_gap_max": max(gaps.values())}
    if not offline_served.get("exact"):
        return out | {"offline_online_agree": None,
                      "offline_online_not_judged": offline_served.get("inexact_because")}
    tolerance = {}
    for m, key in names.items():
        se = offline_served[key].get("standard_error") or 0.0
        n = max(1, offline_served[key].get("samples_counted") or 1)
        se_online = se * (n / max(1, online_prompts)) ** 0.5
        tolerance[m] = max(MIN_OFFLINE_ONLINE_GAP, OFFLINE_ONLINE_SIGMAS * (se ** 2 + se_online ** 2) ** 0.5)
    return out | {"offline_online_tolerance": tolerance,
                  "offline_online_agree": all(gaps[m] <= tolerance[m] for m in names)}


def _fmt_row(label: str, m: dict | None, k: int, extra: str = "") -> str:
    pos = (" | ".join(f"{p:.3f}" for p in m["per_position_acceptance"]) if m and
           "per_position_acceptance" in m else " | ".join("-" for _ in range(k)))
    al = f"{m['mean_acceptance_length']:.3f}" if m and "mean_acceptance_length" in m else "-"
    return f"| {label} | {al} | {pos}{extra} |\n"


def _per_source_table(r: dict) -> str:
    """Mean acceptance length per source, every figure of the report (the user's own traffic
    first in the ingest order is not known here; sources sort by name)."""
    cols: list[tuple[str, dict | None]] = [
        ("offline greedy", r["offline"]),
        ("online greedy", r["online"])]
    s = r.get("as_served")
    if s:
        if r["offline"] and r["offline"].get("as_served"):
            cols += [("offline as served, greedy drafting", r["offline"]["as_served"]["greedy_drafting"]),
                     ("offline as served, probabilistic", r["offline"]["as_served"]["probabilistic_drafting"])]
        cols += [("online as served, greedy drafting", s["runs"]["online"]),
                 ("online as served, probabilistic", s["runs"]["online_probabilistic"]),
                 ("n-gram as served", s["runs"]["ngram"])]
    cols = [(n, m) for n, m in cols if m and m.get("per_source")]
    if not cols:
        return ""
    srcs = sorted({src for _, m in cols for src in m["per_source"]})
    head = "| source | prompts | " + " | ".join(n for n, _ in cols) + " |\n|---|---|" + "---|" * len(cols) + "\n"
    body = ""
    for src in ["all", *srcs]:
        cells = []
        for _, m in cols:
            v = m if src == "all" else m["per_source"].get(src)
            cells.append(f"{v['mean_acceptance_length']:.3f}" if v else "-")
        n = r["prompts"] if src == "all" else r["sources"].get(src, 0)
        body += f"| {src} | {n} | " + " | ".join(cells) + " |\n"
    return ("\n## Per source (mean acceptance length; offline over the store's validation samples, "
            "online over the held-out prompts)\n\n" + head + body)


def _per_turn_kind_table(r: dict) -> str:
    """Greedy acceptance offline by what the first drafted token is: inside an assistant's
    tool call (its name and JSON arguments, as the template writes them) or text."""
    kinds = (r.get("offline") or {}).get("per_turn_kind")
    if not kinds:
        return ""
    k = r["k"]
    head = ("| tokens drafted | drafts | mean acceptance length | " + " | ".join(f"pos {j}" for j in range(k))
            + " |\n|---|---|---|" + "---|" * k + "\n")
    body = "".join(f"| {kind.replace('_', ' ')} | {m['num_drafts']:,.0f} | {m['mean_acceptance_length']:.3f} | "
                   + " | ".join(f"{p:.3f}" for p in m["per_position_acceptance"]) + " |\n"
                   for kind, m in kinds.items())
    return ("\n## Tool calls vs text (offline greedy, the store's validation samples, by the first "
            "drafted token)\n\n" + head + body)


def _agreement_words(s: dict) -> str:
    if s["offline_online_agree"] is None:
        return f"not compared: {s['offline_online_not_judged']}."
    if s["offline_online_agree"]:
        return "offline and online agree (within the sampling noise of both)."
    return ("offline and online DISAGREE (beyond the sampling noise of both): the serving path "
            "does not verify drafts as the target samples, or it feeds the drafter other features "
            "than it was trained on (`eagle-ray check`).")


def _markdown(r: dict) -> str:
    from eagle_ray.evaluate.served import distribution_lines

    k = r["k"]
    h = r["headline"]
    title = (f"# Drafter evaluation\n\n**Expected speedup {h['setting']}: {speedup_text(h)}** "
             f"(output tokens/s with the drafter over without, {h['draft_sample_method']} drafting, "
             f"mean acceptance length {h['mean_acceptance_length']:.2f}; per position "
             + ", ".join(f"{p:.2f}" for p in h["per_position_acceptance"])
             + f"). Measured on {r['device']}.\n\n")
    if r.get("as_served") and not r["as_served"]["distribution_test"]["passed"]:
        title += ("**WARNING: speculation changed the output distribution at the serving profile "
                  "(distribution test below): these figures are not what serving would give.**\n\n")
    head = ("| run | mean acceptance length | " + " | ".join(f"pos {j}" for j in range(k))
            + " | output tok/s |\n|---|---|" + "---|" * k + "---|\n")
    rows = [("offline (store, simulated)", r["offline"], None),
            ("offline, untrained drafter", r["offline_untrained"], None),
            ("online EAGLE-3 (vLLM)", r["online"], r["online"]["tokens_per_s"]),
            ("online untrained drafter", r["untrained"], r["untrained"]["tokens_per_s"]),
            ("online n-gram", r["ngram"], r["ngram"]["tokens_per_s"])]
    if r.get("baseline_drafter"):
        rows.append((f"online baseline drafter ({Path(r['baseline_drafter_dir']).name})",
                     r["baseline_drafter"], r["baseline_drafter"]["tokens_per_s"]))
    body = "".join(_fmt_row(n, m, k, f" | {tps:,.0f}" if tps else " | -") for n, m, tps in rows)
    body += _fmt_row("no speculation", None, k, f" | {r['baseline']['tokens_per_s']:,.0f}")
    served = ""
    if r.get("as_served"):
        s = r["as_served"]
        samp = ", ".join(f"{key} {val}" for key, val in s["sampling"].items())
        served = (f"\n## As served ({samp}; {len(s['seeds'])} seed(s))\n\n"
                  "| run | mean acceptance length | " + " | ".join(f"pos {j}" for j in range(k))
                  + " | spread over seeds | output tok/s | speedup |\n"
                  "|---|---|" + "---|" * k + "---|---|---|\n")
        names = {"online": "EAGLE-3, greedy drafting", "online_probabilistic":
                 "EAGLE-3, probabilistic drafting", "baseline_drafter": "baseline drafter",
                 "untrained": "untrained drafter", "ngram": "n-gram", "baseline": "no speculation"}
        for key, label in names.items():
            m = s["runs"].get(key)
            if m is None:
                continue
            spread = f"{m['spread']:.3f}" if "spread" in m else "-"
            served += _fmt_row(label, m if "mean_acceptance_length" in m else None, k,
                               f" | {spread} | {m['tokens_per_s']:,.0f} | {m['speedup_vs_baseline']:.2f}x")
        served += (f"\nRecommended draft_sample_method: {s['recommended_draft_sample_method']} "
                   "(mean acceptance length: " + ", ".join(
                       f"{m} {a:.3f}" for m, a in s["draft_sample_method"].items()) + ").\n")
        if s.get("offline_expected"):
            served += ("Expected offline from the store at this sampling: " + ", ".join(
                f"{m} drafting {a:.3f} (gap {s['offline_online_gap'][m]:.3f}"
                + (f", tolerance {s['offline_online_tolerance'][m]:.3f})" if s.get("offline_online_tolerance") else ")")
                for m, a in s["offline_expected"].items()) + "; " + _agreement_words(s) + "\n")
        served += "\n" + "\n".join(distribution_lines(s["distribution_test"])) + "\n"
    too_long = r.get("prompts_skipped_too_long") or 0
    skipped = (f" ({too_long} more skipped: longer than the engine's context less max_tokens)"
               if too_long else "")
    return (title + f"## Greedy\n\n{r['prompts']} held-out prompts{skipped}, k = {k}, greedy, "
            f"max_tokens {r['max_tokens']}. Acceptance is {r['metric']}.\n\n{head}{body}\n"
            f"Outputs with speculation identical to without: {r['outputs_identical']}.\n"
            + (f"Offline vs online mean acceptance length gap: {r['offline_online_gap']:.3f}.\n"
               if r["offline_online_gap"] is not None else
               "Offline figures: none (the drafter was trained online, without a store).\n")
            + served + _per_source_table(r) + _per_turn_kind_table(r))


def _plot(r: dict, path: Path) -> None:
    """Render in a child process: importing matplotlib here breaks every later vLLM engine
    in this process (vLLM 0.32's CPU kernel-override scan trips over one of its objects)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "eagle_ray.evaluate.plot", str(path.parent / "report.json"),
                    str(path)], check=True, timeout=120)
