"""The serving profile: the sampling the user serves the target with, resolved for a run.

    field left None in the recipe's `serve` ─▶ the checkpoint's generation_config.json
                                           ─▶ else vLLM's neutral value
    generate.<field> left None             ─▶ the serving profile's (regenerate as served)

Every stage that samples (generate, evaluate as served) and the export's recommended
serving command read the same resolved dict, and manifests record it, so a drafter can be
traced to the distribution it learned and judged against the one it will meet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle_ray.config import Recipe

FIELDS = ("temperature", "top_p", "top_k", "min_p")
# vLLM SamplingParams' neutral values (what a request without these fields gets).
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


def _generation_config(model_dir: str | Path | None) -> dict[str, Any]:
    if model_dir is None:
        return {}
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix or remove it, or state the "
                         "serving profile in the recipe (--set serve.temperature=...)") from None
    if cfg.get("do_sample") is False:  # the checkpoint says greedy
        return {"temperature": 0.0}
    return {k: cfg[k] for k in FIELDS if cfg.get(k) is not None}


def _typed(field: str, value: Any) -> float | int:
    value = int(value) if field == "top_k" else float(value)
    return 0 if field == "top_k" and value < 0 else value  # HF/vLLM write -1 for "no top-k"


def serving_profile(recipe: Recipe, model_dir: str | Path | None) -> dict[str, Any]:
    """{temperature, top_p, top_k, min_p, "from": {field: recipe|generation_config.json|
    vllm default}, "source": the recipe's note}."""
    ckpt = _generation_config(model_dir)
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for f in FIELDS:
        stated = getattr(recipe.serve, f)
        if stated is not None:
            out[f], origin[f] = _typed(f, stated), "recipe"
        elif f in ckpt:
            out[f], origin[f] = _typed(f, ckpt[f]), "generation_config.json"
        else:
            out[f], origin[f] = NEUTRAL[f], "vllm default"
    out["from"] = origin
    out["source"] = recipe.serve.source
    return out


def generation_sampling(recipe: Recipe, model_dir: str | Path | None,
                        profile: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling generation uses: generate.<field> where set, else the serving profile's
    (`profile`, when the caller has it already); plus the seed and samples_per_prompt.
    Refuses several greedy samples per prompt."""
    g = recipe.generate
    profile = profile or serving_profile(recipe, model_dir)
    out = {f: (_typed(f, getattr(g, f)) if getattr(g, f) is not None else profile[f])
           for f in FIELDS}
    if out["temperature"] == 0:  # greedy: the other fields do nothing; record them neutral
        out.update(top_p=1.0, top_k=0, min_p=0.0)
    if g.samples_per_prompt > 1 and out["temperature"] == 0:
        raise ValueError(
            f"generate.samples_per_prompt={g.samples_per_prompt} at temperature 0 (the serving "
            "profile is greedy): the completions of a prompt would all be the same; set "
            "generate.temperature > 0 or generate.samples_per_prompt=1")
    out["seed"] = recipe.engine.seed
    out["samples_per_prompt"] = g.samples_per_prompt
    out["as_served"] = all(out[f] == profile[f] for f in FIELDS)
    return out


def sampling_kwargs(sampling: dict[str, Any]) -> dict[str, Any]:
    """vLLM SamplingParams keyword arguments for a resolved sampling dict (vLLM writes -1 for
    no top-k)."""
    return {"temperature": float(sampling["temperature"]), "top_p": float(sampling["top_p"]),
            "top_k": int(sampling["top_k"]) or -1, "min_p": float(sampling["min_p"])}
