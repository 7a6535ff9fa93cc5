"""`eagle-ray curve`: would more data help? Train the drafter on nested fractions of a run's
training set, judge every one on the same validation set, fit acceptance against training
tokens and extrapolate.

    RUN (a training run: run.json, store)           OUT/
      train ids, grouped by prompt,                   frac-0.125/ run.json, checkpoints/ ...
      shuffled once (seed) -> nested prefixes         frac-0.25/ ... frac-1/
      1/8 c 1/4 c 1/2 c all  (by prompt)              curve.json  curve.md  curve.png

Fractions are nested and cut by PROMPT (all samples of a prompt fall in the same fraction),
so a smaller fraction's data is a subset of every larger one's and no prompt straddles the
validation split (the validation ids are the run's, unchanged).

Step budget: every fraction trains for the SAME number of steps (default: the run's
train.max_steps), so points differ only in the data they saw, not in compute; a small
fraction sees more epochs, as a user with only that much data would train it. (Equal epochs
would give small fractions few steps and confound "too little data" with "too little
training".) The draft vocabulary is the run's (built from the whole training set): a small
fraction is slightly flattered by it, so the fitted slope, if anything, under-states what
more data adds.

The trainings run side by side, one Ray task each (each drives its own Ray Train run with
`curve.workers` workers), so a cluster with room runs them all at once. Every fraction is
then judged offline on the validation split: greedy, and at the serving profile as expected
from the store (greedy and probabilistic drafting, `served`); the largest fraction also online
as served in vLLM. Fit: mean acceptance length L = a + b * log2(training tokens), least
squares; "doubling the data adds b". Extrapolations to 2x, 5x, 10x the data carry the
planner's disk and token cost and a time cost at this run's measured rate.

A killed curve re-run resumes: finished fractions keep their checkpoints (a fraction whose
run.json or split differs is refused), unfinished ones resume from their newest checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from eagle_ray.config import Recipe
from eagle_ray.common.atomic import atomic_write_bytes, atomic_write_json
from eagle_ray.common.provenance import provenance

logger = logging.getLogger(__name__)

EXTRAPOLATE = (2, 5, 10)


def nested_fractions(train_ids: Sequence[str], fractions: Sequence[float], seed: int) -> dict[float, list[str]]:
    """fraction -> training sample ids: nested prefixes of the prompts in one seeded order."""
    from eagle_ray.data.ids import prompt_id

    fr = sorted(set(float(f) for f in fractions))
    if not fr or fr[0] <= 0 or fr[-1] > 1:
        raise ValueError(f"curve fractions must be in (0, 1], got {list(fractions)}")
    by_prompt: dict[str, list[str]] = {}
    for sid in sorted(train_ids):
        by_prompt.setdefault(prompt_id(sid), []).append(sid)
    prompts = sorted(by_prompt)
    random.Random(seed).shuffle(prompts)
    out = {}
    for f in fr:
        n = max(1, math.ceil(f * len(prompts)))
        out[f] = [sid for p in prompts[:n] for sid in by_prompt[p]]
    return out


def fit_log2(tokens: Sequence[float], values: Sequence[float]) -> dict[str, float]:
    """Least squares of values = a + b * log2(tokens); b = what doubling adds; R^2."""
    xs = [math.log2(t) for t in tokens]
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        raise ValueError("a fit needs at least two fractions with different token counts")
    mx, my = sum(xs) / n, sum(values) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, values)) / sxx
    a = my - b * mx
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, values))
    ss_tot = sum((y - my) ** 2 for y in values)
    return {"a": a, "b": b, "r2": 1 - ss_res / ss_tot if ss_tot > 0 else 1.0, "points": n}


def _trial(recipe: Recipe, run: str, info: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """One fraction's training (a Ray task; drives its own Ray Train run)."""
    from eagle_ray.train.run import fit_with_ray_train

    return fit_with_ray_train(recipe, Path(run), info, data)


def run_curve(recipe: Recipe, run_dir: str | Path, out_dir: str | Path, *,
              fractions: Sequence[float] | None = None, steps: int | None = None,
              prompts: str | Path | None = None, online_prompts: int | None = None,
              seed: int = 0) -> dict[str, Any]:
    from eagle_ray.common.outputs import claim_output_dir
    from eagle_ray.targets.identity import check_same_target, recorded_target
    from eagle_ray.targets.resolve import resolve_target_path
    from eagle_ray.targets.serving import serving_profile

    run = Path(run_dir).resolve()
    info = _run_info(run)
    model_dir = resolve_target_path(recipe.target)
    check_same_target(recipe, model_dir, recorded_target(info["store_manifest"]), f"the run {run}")
    c = recipe.curve
    fractions = list(fractions or c.fractions)
    steps = int(steps or c.steps or recipe.train.max_steps)
    online_prompts = c.online_prompts if online_prompts is None else online_prompts
    out = claim_output_dir(out_dir, "curve").resolve()  # Ray Train needs absolute storage paths
    k = recipe.drafter.num_speculative_tokens
    subsets = nested_fractions(info["train_ids"], fractions, seed)

    ntok = _sample_tokens(info["store"])
    t = recipe.train
    r_trial = replace(recipe, train=replace(t, max_steps=steps, eval_interval=steps,
                                            ckpt_interval=steps, num_workers=c.workers))
    infos = _write_fraction_infos(info, subsets, out, run, steps, seed)
    _train_fractions(r_trial, info, subsets, infos, out, steps)

    profile = serving_profile(recipe, model_dir)
    sampling = profile if profile["temperature"] > 0 else None
    points = _judge_offline(infos, subsets, ntok, out, k, sampling)
    headline, fits = _fit_points(points, sampling)
    online = None
    if prompts is not None and online_prompts > 0 and sampling:
        online = _online_largest(recipe, model_dir, out, max(infos), prompts, online_prompts, info,
                                 profile, k)
        points[-1]["online_as_served_probabilistic"] = online["probabilistic"]
        points[-1]["online_as_served_greedy_drafting"] = online["greedy"]

    extrap = _extrapolate(recipe, points, fits[headline], k, run, out)
    fit = fits[headline]
    sentence = (f"Doubling the data is predicted to add {fit['b']:+.2f} to the mean acceptance length "
                f"({headline.replace('_', ' ')}; fit over {fit['points']} points; R^2 = {fit['r2']:.2f}).")
    result = {"run": str(run), "fractions": fractions, "steps": steps, "seed": seed, "k": k,
              "val_samples": len(info["val_ids"]), "serving_profile": profile if sampling else None,
              "points": points, "fits": fits, "headline_metric": headline, "extrapolation": extrap,
              "online_largest": online, "sentence": sentence,
              "budget": "same number of steps for every fraction (see eagle_ray.evaluate.curve)",
              "provenance": provenance()}
    atomic_write_json(out / "curve.json", result)
    atomic_write_bytes(out / "curve.md", curve_markdown(result).encode())
    _plot(out)
    return result


def _run_info(run: Path) -> dict[str, Any]:
    """The training run's run.json, refused without one or without a store."""
    if not (run / "run.json").exists():
        raise FileNotFoundError(f"{run / 'run.json'} does not exist: pass the --out of `eagle-ray train`")
    info = json.loads((run / "run.json").read_text())
    if not info.get("store"):
        raise ValueError(f"{run} was trained online (no store): the curve needs a hidden-state store")
    return info


def _sample_tokens(store_dir: str) -> dict[str, int]:
    """sample id -> its token count, from the store's index."""
    from eagle_ray.store.reader import HiddenStateStore

    store = HiddenStateStore(store_dir)
    idx = store.index_table()
    return dict(zip(idx.column("sample_id").to_pylist(), idx.column("num_tokens").to_pylist()))


def _write_fraction_infos(info: dict[str, Any], subsets: dict[float, list[str]], out: Path, run: Path,
                          steps: int, seed: int) -> dict[float, dict[str, Any]]:
    """Write every fraction's run.json (refusing another curve's fraction); fraction -> that info."""
    infos = {}
    for f, ids in subsets.items():
        fdir = out / f"frac-{f:g}"
        finfo = {**info, "train_ids": ids, "curve": {"fraction": f, "of_run": str(run), "steps": steps,
                                                      "seed": seed}}
        if (fdir / "run.json").exists():
            old = json.loads((fdir / "run.json").read_text())
            if old.get("train_ids") != ids or old.get("val_ids") != info["val_ids"] or \
                    (old.get("curve") or {}).get("steps") != steps:
                raise ValueError(f"{fdir} holds another curve's fraction (other samples or steps); "
                                 "use a new --out")
        fdir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(fdir / "run.json", finfo)
        infos[f] = finfo
    return infos


def _train_fractions(r_trial: Recipe, info: dict[str, Any], subsets: dict[float, list[str]],
                     infos: dict[float, dict[str, Any]], out: Path, steps: int) -> None:
    """Train every fraction not trained yet to `steps`, side by side as Ray tasks; wait for all."""
    import ray

    from eagle_ray.ops.cluster import init_ray
    from eagle_ray.train.checkpoint import newest_loadable as latest_checkpoint

    trials = {}
    init_ray()
    todo = {f: out / f"frac-{f:g}" for f in subsets}
    done = {}
    for f, fdir in todo.items():
        ck = latest_checkpoint(fdir)
        if ck is not None and json.loads((ck / "state.json").read_text())["step"] >= steps:
            done[f] = True
            logger.info("curve: fraction %g already trained (%s)", f, ck.name)
    remote = ray.remote(num_cpus=0)(_trial)
    for f, fdir in todo.items():
        if f not in done:
            logger.info("curve: training fraction %g (%d samples, %d steps) as a Ray task", f,
                        len(subsets[f]), steps)
            trials[f] = remote.remote(r_trial, str(fdir), infos[f], {"store": info["store"]})
    for f, ref in trials.items():
        ray.get(ref)
        logger.info("curve: fraction %g trained", f)


def _judge_offline(infos: dict[float, dict[str, Any]], subsets: dict[float, list[str]], ntok: dict[str, int],
                   out: Path, k: int, sampling: dict | None) -> list[dict[str, Any]]:
    """Every fraction's newest checkpoint judged offline on the validation split: one point each."""
    from safetensors.torch import load_file

    from eagle_ray.evaluate.acceptance import offline_acceptance
    from eagle_ray.train.checkpoint import newest_loadable as latest_checkpoint

    points = []
    for i, (f, finfo) in enumerate(infos.items()):
        logger.info("curve: judging fraction %g offline (%d of %d)", f, i + 1, len(infos))
        ck = latest_checkpoint(out / f"frac-{f:g}")
        off = offline_acceptance(finfo, load_file(str(ck / "model.safetensors")), k, sampling=sampling)
        pt = {"fraction": f, "samples": len(subsets[f]), "tokens": sum(ntok[s] for s in subsets[f]),
              "greedy": off["mean_acceptance_length"]}
        if sampling:
            pt["as_served_greedy_drafting"] = off["as_served"]["greedy_drafting"]["mean_acceptance_length"]
            pt["as_served_probabilistic"] = off["as_served"]["probabilistic_drafting"]["mean_acceptance_length"]
        points.append(pt)
    return points


def _fit_points(points: list[dict[str, Any]], sampling: dict | None) -> tuple[str, dict[str, dict[str, float]]]:
    """The headline metric and a log2 fit of every metric the points carry."""
    metrics = [m for m in ("as_served_probabilistic", "as_served_greedy_drafting", "greedy") if m in points[0]]
    # The headline follows what the user will serve: at a sampled profile, the drafting method
    # the largest fraction accepts more with (as evaluate recommends); greedy otherwise.
    headline = max(metrics[:2], key=lambda m: points[-1][m]) if sampling else "greedy"
    fits = {m: fit_log2([p["tokens"] for p in points], [p[m] for p in points]) for m in metrics}
    return headline, fits


def _online_largest(recipe, model_dir, out, f, prompts, n, info, profile, k) -> dict[str, float]:
    """The largest fraction's drafter online in vLLM at the serving profile (one seed)."""
    from transformers import AutoTokenizer

    from eagle_ray.evaluate.acceptance import online_runs_isolated, prompts_from_ingest
    from eagle_ray.export.drafter import export_drafter
    from eagle_ray.evaluate.run import held_out_limit
    from eagle_ray.vllm.engine import engine_kwargs

    drafter = export_drafter(out / f"frac-{f:g}", out / f"frac-{f:g}" / "drafter")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    held = prompts_from_ingest(prompts, tok, n, exclude_ids=set(info["train_ids"]),
                               max_prompt_tokens=held_out_limit(recipe))
    specs = {method: {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": k,
                      "draft_sample_method": method} for method in ("greedy", "probabilistic")}
    runs = online_runs_isolated(
        engine_kwargs(recipe, str(model_dir)), held, recipe.generate.max_tokens, specs,
        {"sampling": profile, "seeds": [0]},
        on_start=lambda i, method: logger.info("curve: largest fraction online as served, %s "
                                               "drafting (%d prompts)", method, len(held)))
    return {m: r["sampled"][0]["mean_acceptance_length"] for m, r in runs.items()}


def _extrapolate(recipe: Recipe, points: list[dict], fit: dict, k: int, run: Path, out: Path) -> list[dict]:
    """Predicted acceptance at 2x/5x/10x the data, with the planner's disk and token cost and
    the time this run's generation + extraction took per sample, scaled."""
    from eagle_ray.plan.budget import make_plan

    full = points[-1]
    summary = _json(run.parent / "summary.json")
    per_sample_s = None
    if summary and (summary.get("timings_s") or {}).get("generate_extract") and full["samples"]:
        n_run = (summary.get("extract") or {}).get("samples") or full["samples"]
        per_sample_s = summary["timings_s"]["generate_extract"] / max(1, n_run)
    avg = full["tokens"] / max(1, full["samples"])
    rows = []
    for mult in EXTRAPOLATE:
        n = int(full["samples"] * mult)
        plan = make_plan(recipe, num_samples=n, avg_tokens=avg, out_dir=out, free=0)
        pred = fit["a"] + fit["b"] * math.log2(full["tokens"] * mult)
        rows.append({"data": f"{mult}x", "samples": n, "tokens": plan.total_tokens,
                     "predicted": min(k + 1.0, pred), "capped": pred > k + 1,
                     "store_bytes": plan.total_bytes,
                     "generate_extract_s": per_sample_s * n if per_sample_s else None})
    return rows


def curve_markdown(r: dict[str, Any]) -> str:
    metrics = [m for m in ("greedy", "as_served_greedy_drafting", "as_served_probabilistic",
                           "online_as_served_greedy_drafting", "online_as_served_probabilistic")
               if any(m in p for p in r["points"])]
    head = "| fraction | samples | tokens | " + " | ".join(m.replace("_", " ") for m in metrics) + " |\n"
    head += "|---|---|---|" + "---|" * len(metrics) + "\n"
    body = "".join(f"| {p['fraction']:g} | {p['samples']:,} | {p['tokens']:,} | "
                   + " | ".join(f"{p[m]:.3f}" if m in p else "-" for m in metrics) + " |\n"
                   for p in r["points"])
    fits = "\n".join(f"- {m.replace('_', ' ')}: L = {f['a']:.3f} + {f['b']:.3f} * log2(tokens), "
                     f"R^2 = {f['r2']:.3f}" for m, f in r["fits"].items())
    ex = "| data | samples | tokens | predicted mean acceptance length | store | generate + extract time |\n"
    ex += "|---|---|---|---|---|---|\n"
    for e in r["extrapolation"]:
        t = f"{_duration(e['generate_extract_s'])} at this run's rate" if e["generate_extract_s"] else "-"
        ex += (f"| {e['data']} | {e['samples']:,} | {e['tokens']:,} | {e['predicted']:.2f}"
               f"{' (capped at k + 1)' if e['capped'] else ''} | {e['store_bytes'] / 1e9:.2f} GB | {t} |\n")
    return (f"# Would more data help?\n\n**{r['sentence']}**\n\n"
            f"Nested fractions of {r['run']}'s training set (by prompt), {r['steps']} steps each, "
            f"judged offline on the same {r['val_samples']} validation samples (k = {r['k']}).\n\n"
            f"{head}{body}\nFits (mean acceptance length vs training tokens):\n\n{fits}\n\n"
            f"## Extrapolation ({r['headline_metric'].replace('_', ' ')})\n\n{ex}")


def _duration(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 5400 else f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"


def _plot(out: Path) -> None:
    """Render in a child process (matplotlib and vLLM must not share a process here)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "eagle_ray.evaluate.plot", "--curve", str(out / "curve.json"),
                    str(out / "curve.png")], check=True, timeout=120)


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
