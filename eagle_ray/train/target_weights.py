"""Load single tensors of the target by name, never the whole model.

A 1T-parameter target is 60+ safetensors shards; the drafter needs two tensors (the token
embedding, and for the teacher the lm_head). `model.safetensors.index.json` says which
shard holds each name; only those shards are opened (memory-mapped) and only those
tensors read.
"""

from __future__ import annotations

import json
from pathlib import Path

EMBED_SUFFIX = "embed_tokens.weight"
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")


def _weight_map(model_dir: Path) -> dict[str, str]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{model_dir} has neither model.safetensors nor its index")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: single.name for k in f.keys()}


def load_tensors(model_dir: str | Path, names: list[str]):
    from safetensors import safe_open

    model_dir = Path(model_dir)
    wmap = _weight_map(model_dir)
    out = {}
    for name in names:
        if name not in wmap:
            raise KeyError(f"{model_dir}: no tensor named {name!r}")
        with safe_open(str(model_dir / wmap[name]), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def load_embed_and_lm_head(model_dir: str | Path):
    """(embedding [V, H], lm_head [V, H]); a tied model returns the embedding twice."""
    model_dir = Path(model_dir)
    wmap = _weight_map(model_dir)
    embed = sorted(n for n in wmap if n.endswith(EMBED_SUFFIX) and "mtp" not in n)
    if not embed:
        raise KeyError(f"{model_dir}: no *{EMBED_SUFFIX} tensor")
    head = [n for n in LM_HEAD_NAMES if n in wmap]
    t = load_tensors(model_dir, [embed[0]] + head[:1])
    e = t[embed[0]]
    return e, (t[head[0]] if head else e)
