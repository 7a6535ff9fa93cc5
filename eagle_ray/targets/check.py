"""Does a downloaded checkpoint match its recipe? (`eagle-ray recipes NAME --check-target DIR`)

Reads only small files: config.json, the weight index (model.safetensors.index.json, or the
header of a single model.safetensors) and the tokenizer's config. No weight is loaded, so it
answers in a second for a 1T-parameter checkpoint, before a multi-hour job finds out.

What is compared (every mismatch is reported, not just the first):

    config.json  architectures[0]         == target.architecture
                 text model (text_config  hidden_size, num_hidden_layers, vocab_size,
                   when present)          num_attention_heads, intermediate_size == the recipe's
    weight index every shard it names exists on disk and is non-empty (a partial download)
                 the embedding and lm_head tensors training loads by name are present
                 decoder layers 0..L-1 all have weights under the text model's prefix
    tokenizer    custom code (auto_map in tokenizer_config.json / config.json, or the recipe's
                 `remote_code` note) requires target.trust_remote_code=true: the user opts in

The remote-code rule is also enforced at run time (`require_remote_code_consent`, called when
a recipe's target is resolved), so no stage runs a checkpoint's Python code unasked.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from eagle_ray.config import Recipe, TargetConfig

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def remote_code_reasons(target: TargetConfig, model_dir: Path) -> list[str]:
    """Why this target needs `trust_remote_code` (empty: it does not)."""
    reasons = [target.remote_code] if target.remote_code else []
    for name in ("tokenizer_config.json", "config.json"):
        cfg = _json(model_dir / name) or {}
        amap = cfg.get("auto_map") or {}
        if name == "config.json":  # vLLM ships its own model class; only a tokenizer forces it
            amap = {k: v for k, v in amap.items() if "Tokenizer" in k}
        if amap:
            reasons.append(f"{model_dir / name} maps {', '.join(sorted(amap))} to code in the "
                           "checkpoint")
    return reasons


def require_remote_code_consent(target: TargetConfig, model_dir: Path) -> None:
    """Refuse to run a target whose tokenizer/model is custom code unless the user allowed it."""
    reasons = remote_code_reasons(target, model_dir)
    if reasons and not target.trust_remote_code:
        raise ValueError(
            f"target {target.path} needs custom code from the checkpoint ({'; '.join(reasons)}). "
            "Running it is your decision: read that code, then allow it with "
            "--set target.trust_remote_code=true")


def _weight_index(model_dir: Path) -> tuple[dict[str, str] | None, str | None]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        data = _json(index) or {}
        if "weight_map" not in data:
            return None, f"{index} has no weight_map"
        return data["weight_map"], None
    single = model_dir / "model.safetensors"
    if single.exists():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:  # reads the header only
            return {k: single.name for k in f.keys()}, None
    return None, f"{model_dir} has neither model.safetensors.index.json nor model.safetensors"


def check_target_dir(recipe: Recipe, model_dir: str | Path) -> list[str]:
    """Every way the checkpoint in model_dir differs from what recipe.target says."""
    d = Path(model_dir)
    t = recipe.target
    cfg = _json(d / "config.json")
    if cfg is None:
        return [f"{d / 'config.json'} is missing: is {d} a Hugging Face model directory?"]
    problems: list[str] = []
    arch = (cfg.get("architectures") or [None])[0]
    if arch != t.architecture:
        problems.append(f"architecture: recipe says {t.architecture}, {d / 'config.json'} says {arch}")
    text = cfg.get("text_config", cfg)
    for field, key in (("hidden_size", "hidden_size"), ("num_layers", "num_hidden_layers"),
                       ("vocab_size", "vocab_size"), ("num_attention_heads", "num_attention_heads"),
                       ("intermediate_size", "intermediate_size")):
        got, want = text.get(key), getattr(t, field)
        if got != want:
            where = "text_config." + key if "text_config" in cfg else key
            problems.append(f"{where}: recipe says target.{field}={want}, checkpoint has {got}")

    wmap, err = _weight_index(d)
    if err:
        problems.append(err)
    else:
        missing = sorted({f for f in wmap.values() if not (d / f).exists() or (d / f).stat().st_size == 0})
        if missing:
            problems.append(f"{len(missing)} weight file(s) named by the index are missing or "
                            f"empty (incomplete download?): {', '.join(missing[:5])}"
                            + (" ..." if len(missing) > 5 else ""))
        from eagle_ray.targets.load import EMBED_SUFFIX, LM_HEAD_NAMES

        if not any(n.endswith(EMBED_SUFFIX) and "mtp" not in n for n in wmap):
            problems.append(f"no *{EMBED_SUFFIX} tensor in the weight index (training loads it)")
        if not any(n in wmap for n in LM_HEAD_NAMES) and not text.get("tie_word_embeddings"):
            problems.append(f"no lm head ({' or '.join(LM_HEAD_NAMES)}) in the weight index "
                            "(the teacher needs it)")
        prefix = "language_model.model.layers." if "text_config" in cfg else "model.layers."
        layers = {int(m.group(1)) for n in wmap if n.startswith(prefix) and (m := _LAYER.search(n))}
        want_layers = set(range(t.num_layers))
        if layers and layers != want_layers and not want_layers <= layers:
            problems.append(f"decoder layers with weights under {prefix}*: "
                            f"{min(layers)}..{max(layers)} ({len(layers)}), recipe says "
                            f"{t.num_layers}; missing {sorted(want_layers - layers)[:8]}")
        elif not layers:
            problems.append(f"no decoder-layer weights under {prefix}* in the weight index")

    reasons = remote_code_reasons(t, d)
    if reasons and not t.trust_remote_code:
        problems.append("needs custom code (" + "; ".join(reasons) + ") and the recipe does not "
                        "allow it: --set target.trust_remote_code=true once you have read it")
    return problems
