"""Reading a target checkpoint with transformers: plain causal LMs and multimodal wrappers.

Most targets are one causal LM per directory (`config.json` is the text model's config,
weights are named `model.*` / `lm_head.weight`); `AutoModelForCausalLM` loads them.
Kimi-K2.5 is a multimodal wrapper: config.json holds the text model's config under
`text_config` and every language-model weight is stored under `language_model.*`:

    config.json                  {"architectures": ["KimiK25ForConditionalGeneration"],
                                  "model_type": "kimi_k25", "text_config": {DeepSeek-V3 ...},
                                  "vision_config": {...}, ...}
    weights                      language_model.model.embed_tokens.weight
                                 language_model.model.layers.{i}....
                                 language_model.model.norm.weight
                                 language_model.lm_head.weight
                                 vision_tower.*, mm_projector.*   (the real one; not needed)

The pipeline only ever needs the text model (EAGLE-3 drafts text), so for a wrapper we
build the text model's own causal-LM class from `text_config` (`DeepseekV3ForCausalLM`
for Kimi) and load the `language_model.*` tensors with the prefix stripped; vision
tensors are skipped. That is also what vLLM runs with `language_model_only=True`.
transformers >= 5.16 could load the whole wrapper natively (`Kimi_K25ForConditionalGeneration`),
but that would build and load the vision tower (400M parameters on the real model) for
nothing. Loading is strict: a language-model tensor missing from the checkpoint (which
transformers would otherwise initialise randomly with a warning) raises.

The HF extract backend and the tests' references both load through `load_causal_lm`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Wrapper checkpoints whose text model lives under a weight-name prefix.
LANGUAGE_MODEL_PREFIX = "language_model."
# Tensors of a wrapper that the text model does not use.
NON_TEXT_PREFIXES = ("vision_tower.", "mm_projector.")


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json of a local target directory, as a dict."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: `text_config` of a multimodal wrapper, else config itself.
    Read hidden_size, num_hidden_layers, vocab_size etc. from this, never from the top level
    (Kimi-K2.5's top level has none of them)."""
    return config.get("text_config") or config


def is_wrapper(config: dict[str, Any]) -> bool:
    """A multimodal wrapper whose text model is nested (config `text_config`)."""
    return isinstance(config.get("text_config"), dict)


def load_causal_lm(model_dir: str | Path, *, dtype: str = "float32", revision: str | None = None,
                   trust_remote_code: bool = False):
    """The target's text causal LM in transformers (eval mode, on the CPU).

    Plain targets: `AutoModelForCausalLM.from_pretrained`. Wrappers (Kimi-K2.5 and its twin):
    the text model class from `text_config` with `language_model.*` weights (prefix stripped;
    transformers' own checkpoint conversion still applies, e.g. it fuses DeepSeek-V3's
    per-expert tensors into its 3-D expert parameters).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from eagle_ray.common.logs import verbose

    if not verbose():  # transformers' "Loading weights" bar, from every extractor, on the console
        hf_logging.disable_progress_bar()
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    path = str(model_dir)
    local = Path(model_dir) / "config.json"
    cfg_dict = read_config(model_dir) if local.exists() else None
    if cfg_dict is None or not is_wrapper(cfg_dict):
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, revision=revision,
            trust_remote_code=trust_remote_code).eval()

    cfg = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    tcfg = cfg.get_text_config()
    model_cls = AutoModelForCausalLM._model_mapping[type(tcfg)]  # noqa: SLF001 (no public text-config -> class map)
    model, info = model_cls.from_pretrained(
        path, config=tcfg, dtype=torch_dtype, revision=revision,
        key_mapping={"^" + LANGUAGE_MODEL_PREFIX.replace(".", r"\."): ""},
        output_loading_info=True)
    unexpected = [k for k in info.get("unexpected_keys", ())
                  if not k.startswith(NON_TEXT_PREFIXES)]
    problems = {k: v for k, v in (("missing", list(info.get("missing_keys", ()))),
                                  ("unexpected", unexpected),
                                  ("mismatched", list(info.get("mismatched_keys", ())))) if v}
    if problems:
        raise ValueError(f"{model_dir}: the {LANGUAGE_MODEL_PREFIX}* tensors do not match "
                         f"{model_cls.__name__}: {problems}")
    return model.eval()


# --------------------------------------------------------------------------- single tensors
# Load single tensors of the target by name, never the whole model. A 1T-parameter target is
# 60+ safetensors shards; the drafter needs two tensors (the token embedding, and for the
# teacher the lm_head). `model.safetensors.index.json` says which shard holds each name; only
# those shards are opened (memory-mapped) and only those tensors read.

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


def load_last_layer(model_dir: str | Path, suffixes: tuple[str, ...]):
    """The target's last decoder layer (`{prefix}layers.{L-1}.{suffix}` for each suffix, the
    language model's, never an MTP or vision layer) and its final norm (`{prefix}norm.weight`),
    keyed by suffix and "norm.weight"; KeyError naming what the checkpoint lacks."""
    model_dir = Path(model_dir)
    last = int(text_config(read_config(model_dir))["num_hidden_layers"]) - 1
    wmap = _weight_map(model_dir)
    lm = [n for n in wmap if "mtp" not in n and "vision" not in n and "visual" not in n]
    names, missing = {}, []
    for suffix in suffixes:
        hit = sorted(n for n in lm if n.endswith(f"layers.{last}.{suffix}"))
        if hit:
            names[suffix] = hit[0]
        else:
            missing.append(f"layers.{last}.{suffix}")
    norms = sorted(n for n in lm if n.endswith("norm.weight") and "layers." not in n)
    if norms:
        names["norm.weight"] = min(norms, key=len)
    else:
        missing.append("the final norm.weight")
    if missing:
        raise KeyError(f"{model_dir}: no tensor {', '.join(missing)} (is its last layer a Llama-like "
                       "decoder layer?)")
    t = load_tensors(model_dir, list(names.values()))
    return {k: t[n] for k, n in names.items()}
