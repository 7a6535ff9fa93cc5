"""Never mix two targets silently: a store, a run or a drafter belongs to the target it was
captured from, named by its content fingerprint (config, tokenizer, weight files).

Two targets can share every shape and the tokenizer (Kimi-K2 and Kimi-K2.5; here the tiny
Llama and the tiny Kimi twin): features of one with the embeddings and teacher of the other
train without an error and give a drafter for neither. So train (offline and online),
check, evaluate and `train.init_from` compare the recipe's target with the recorded one
before any worker starts, and refuse naming both. `target.allow_other_target=true` is the
override for the deliberate case (the same weights re-saved, say).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle_ray.config import Recipe


class TargetMismatchError(ValueError):
    """The recipe's target is not the one a store / run / drafter was made from."""


def recorded_target(manifest: dict[str, Any]) -> dict[str, Any]:
    """{path, architecture, fingerprint} from a store manifest (or a manifest-like dict)."""
    return {"path": manifest.get("target_path"), "architecture": manifest.get("architecture"),
            "fingerprint": manifest.get("target_fingerprint")}


def check_same_target(recipe: Recipe, target_dir: str | Path, recorded: dict[str, Any],
                      what: str) -> None:
    """Refuse when `recorded` (a store's / run's / drafter's target) is not the recipe's
    target; `what` names the thing ("the store /x"). A record without a fingerprint (a
    published drafter) is not compared here: its shapes are."""
    from eagle_ray.common.provenance import target_fingerprint

    have = recorded.get("fingerprint")
    if not have or recipe.target.allow_other_target:
        return
    mine = target_fingerprint(target_dir)
    if mine == have:
        return
    raise TargetMismatchError(
        f"{what} was made from another target: {recorded.get('path')!r} "
        f"({recorded.get('architecture')}, fingerprint {have[:12]}), but recipe "
        f"{recipe.name} runs {recipe.target.path!r} ({recipe.target.architecture}, fingerprint "
        f"{mine[:12]}, at {target_dir}). Features of one target with the embeddings and teacher "
        "of another train a drafter for neither. Use the recipe (or --set target.path=...) of "
        f"the target {what} was made from; if the two really are the same model (re-saved), "
        "--set target.allow_other_target=true")
