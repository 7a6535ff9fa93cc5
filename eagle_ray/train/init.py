"""Start a run from a published EAGLE-3 drafter (`train.init_from = DIR`): weights only.

Two layouts are read (both loaded with safetensors, never pickle):

    vLLM / EAGLE-3 / SpecForge (what `eagle-ray export` writes)
        config.json   architectures ["LlamaForCausalLMEagle3"] (or Eagle3LlamaForCausalLM),
                      Llama fields, draft_vocab_size, eagle_aux_hidden_state_layer_ids
                      (top level or in eagle_config)
        tensors       fc, midlayer.*, norm, lm_head, d2t (offsets), t2d
    vllm-project/speculators
        config.json   speculators_model_type "eagle3", transformer_layer_config (the Llama
                      fields), draft_vocab_size, norm_before_residual, target_hidden_size,
                      eagle_aux_hidden_state_layer_ids
        tensors       fc, layers.0.* (= midlayer.*), norm, lm_head, d2t, t2d, embed_tokens
                      (a frozen copy of the target's embedding: dropped, the target's is used)

Before any Ray worker starts, `check_published` compares the drafter with the target, the
data and the recipe's drafter shape, and refuses with every mismatch named: hidden size and
target hidden size, aux layer ids (the store's, or an online run's), target vocabulary,
attention and MLP shapes, layer count, variants this model does not implement.

Draft vocabulary:
    keep (default)  the published d2t: lm_head row i keeps meaning the token it was trained
                    for (SpecForge rebuilds the mapping and misaligns every row, their #534)
    data            the draft vocabulary is rebuilt from the user's loss tokens; each token
                    that survives carries its lm_head row to its new slot, new tokens start
                    from the fresh initialisation

        old slot j ── target token t ──▶ new slot i   (lm_head_new[i] = lm_head_old[j])
        new slot i, t not in the old vocabulary      (lm_head_new[i] = fresh init)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INIT_VOCABS = ("keep", "data")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_LAYER_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size")


@dataclass
class PublishedDrafter:
    path: Path
    layout: str                          # "vllm" | "speculators"
    config: dict[str, Any]               # normalised fields (see read_published)
    state: dict[str, Any]                # tensors in eagle_ray's export names
    recorded_target: dict[str, Any] = field(default_factory=dict)  # our own exports only
    unsupported: list[str] = field(default_factory=list)


def _load_tensors(d: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    index = d / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d} holds no .safetensors weights (train.init_from needs a "
                                "drafter directory: config.json + model.safetensors)")
    out: dict[str, Any] = {}
    for f in files:
        out.update(load_file(str(d / f)))
    return out


def _aux_ids(cfg: dict) -> list[int] | None:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return [int(i) for i in ids] if ids else None


def _rope_theta(cfg: dict) -> float | None:
    rp = cfg.get("rope_parameters") or {}
    if isinstance(rp, dict) and rp.get("rope_theta") is not None:
        return float(rp["rope_theta"])
    return float(cfg["rope_theta"]) if cfg.get("rope_theta") is not None else None


def read_published(path: str | Path) -> PublishedDrafter:
    """Read a drafter directory in either layout into eagle_ray's names."""
    d = Path(path)
    if not (d / "config.json").exists():
        raise FileNotFoundError(f"train.init_from={d}: no config.json there (a drafter directory "
                                "holds config.json + model.safetensors)")
    raw = json.loads((d / "config.json").read_text())
    tensors = _load_tensors(d)
    unsupported: list[str] = []
    if raw.get("speculators_model_type") is not None:
        if raw["speculators_model_type"] != "eagle3":
            raise ValueError(f"{d}: speculators_model_type {raw['speculators_model_type']!r}; "
                             "train.init_from reads EAGLE-3 drafters only")
        layout, layer = "speculators", dict(raw.get("transformer_layer_config") or {})
        if layer.get("model_type", "llama") != "llama":
            unsupported.append(f"transformer_layer_config.model_type={layer.get('model_type')!r} "
                               "(this drafter is a Llama layer)")
        # vLLM reads a missing norm_before_residual as True for this layout.
        if raw.get("norm_before_residual", True):
            unsupported.append("norm_before_residual=true (this drafter adds the residual "
                               "before its norm)")
        for key in ("norm_before_fc", "fc_norm", "norm_output"):
            if raw.get(key):
                unsupported.append(f"{key}=true")
        state = {}
        for k, v in tensors.items():
            if k.startswith("embed_tokens."):
                continue  # the target's own embedding is used (frozen), as vLLM shares it
            state[k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k] = v
        cfg = {**layer, "draft_vocab_size": raw.get("draft_vocab_size"),
               "target_hidden_size": raw.get("target_hidden_size"),
               "aux_layer_ids": _aux_ids(raw) or _aux_ids(layer)}
    else:
        archs = raw.get("architectures") or []
        if not any(a in EAGLE3_ARCHITECTURES for a in archs):
            raise ValueError(f"{d}: architectures {archs} is not an EAGLE-3 Llama drafter "
                             f"({' or '.join(EAGLE3_ARCHITECTURES)}, or a speculators config)")
        layout = "vllm"
        if raw.get("norm_before_residual"):
            unsupported.append("norm_before_residual=true")
        state = {k: v for k, v in tensors.items() if not k.startswith("embed_tokens.")}
        cfg = {**raw, "aux_layer_ids": _aux_ids(raw)}
    if cfg.get("rope_scaling"):
        unsupported.append(f"rope_scaling={cfg['rope_scaling']} (plain RoPE only)")
    n_layers = int(cfg.get("num_hidden_layers", 1))
    heads = int(cfg["num_attention_heads"])
    norm = {
        "hidden_size": int(cfg["hidden_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        "intermediate_size": int(cfg["intermediate_size"]),
        "num_hidden_layers": n_layers,
        "vocab_size": int(cfg["vocab_size"]),
        "draft_vocab_size": int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
        "target_hidden_size": int(cfg.get("target_hidden_size") or cfg["hidden_size"]),
        "aux_layer_ids": cfg.get("aux_layer_ids"),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(cfg),
    }
    ours = raw.get("eagle_ray") or {}
    recorded = {"path": ours.get("target_path"), "architecture": None,
                "fingerprint": (ours.get("store") or {}).get("target_fingerprint")}
    return PublishedDrafter(path=d, layout=layout, config=norm, state=state,
                            recorded_target=recorded, unsupported=unsupported)


def check_published(pub: PublishedDrafter, arch, manifest: dict[str, Any], init_vocab: str) -> None:
    """Refuse, naming every mismatch, a drafter that does not fit this target, these
    features and the recipe's drafter shape."""
    c, problems = pub.config, list(pub.unsupported)
    if c["num_hidden_layers"] != arch.num_layers:
        problems.append(f"num_hidden_layers {c['num_hidden_layers']} vs the recipe's drafter "
                        f"{arch.num_layers} (--set drafter.num_layers={c['num_hidden_layers']})")
    if c["target_hidden_size"] != manifest["hidden_size"]:
        problems.append(f"target hidden size {c['target_hidden_size']} vs the target's "
                        f"{manifest['hidden_size']}")
    if c["vocab_size"] != manifest["vocab_size"]:
        problems.append(f"target vocabulary {c['vocab_size']:,} vs the target's "
                        f"{manifest['vocab_size']:,}")
    want_ids = [int(i) for i in manifest["aux_layer_ids"]]
    L = int(manifest["num_layers"])
    have_ids = c["aux_layer_ids"] or [2, L // 2, L - 3]  # unstated: vLLM serves the default
    if have_ids != want_ids:
        problems.append(f"aux layer ids {have_ids}{'' if c['aux_layer_ids'] else ' (unstated: the default)'} "
                        f"vs the features' {want_ids} (fc was trained on other layers; capture "
                        f"those with --set target.aux_layer_ids={','.join(map(str, have_ids))})")
    fixes = {"num_attention_heads": "drafter.num_attention_heads",
             "num_key_value_heads": "drafter.num_key_value_heads", "head_dim": "drafter.head_dim",
             "intermediate_size": "drafter.intermediate_size", "hidden_size": None}
    for key in _LAYER_KEYS:
        mine = getattr(arch, key)
        if c[key] != mine:
            fix = f" (--set {fixes[key]}={c[key]})" if fixes[key] else ""
            problems.append(f"{key} {c[key]} vs the recipe's drafter {mine}{fix}")
    if init_vocab == "keep" and c["draft_vocab_size"] != arch.draft_vocab_size:
        problems.append(f"draft vocabulary {c['draft_vocab_size']:,} vs the recipe's "
                        f"{arch.draft_vocab_size:,} (--set drafter.draft_vocab_size="
                        f"{c['draft_vocab_size']} keeps the published one; or "
                        "--set train.init_vocab=data rebuilds it from your data)")
    for name in ("fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight"):
        if name not in pub.state:
            problems.append(f"tensor {name} missing")
    if problems:
        raise ValueError(f"train.init_from={pub.path} ({pub.layout} layout) does not fit this run: "
                         + "; ".join(problems))


def published_d2t(pub: PublishedDrafter):
    """The published drafter's d2t (offsets), identity for a full-vocabulary drafter."""
    import torch

    if "d2t" in pub.state:
        return pub.state["d2t"].to(torch.int64)
    return torch.zeros(pub.config["draft_vocab_size"], dtype=torch.int64)


def init_state(pub: PublishedDrafter, arch, d2t_new, seed: int) -> tuple[dict[str, Any], dict[str, int]]:
    """The run's initial drafter state (eagle_ray's export names, d2t/t2d of the run) and
    counts of lm_head rows carried over / started fresh."""
    import torch

    from eagle_ray.export.vllm_layout import export_param_names
    from eagle_ray.model.drafter import Eagle3Drafter
    from eagle_ray.model.vocab import draft_target_ids, target_to_draft_map

    torch.manual_seed(seed)
    fresh = Eagle3Drafter(arch, d2t=d2t_new)  # the run's vocabulary, fresh weights
    state = {k: v.detach().clone() for k, v in fresh.state_dict().items()}
    for name in export_param_names(arch.num_layers):
        if name in ("d2t", "t2d", "lm_head.weight"):
            continue
        w = pub.state[name]
        if tuple(w.shape) != tuple(state[name].shape):
            raise ValueError(f"train.init_from={pub.path}: tensor {name} is {tuple(w.shape)}, "
                             f"this drafter's is {tuple(state[name].shape)}")
        state[name] = w.to(state[name].dtype).clone()
    old_d2t = published_d2t(pub)
    old_ids = draft_target_ids(old_d2t)                   # [N_old] target id of each old row
    old_slot = target_to_draft_map(old_d2t, arch.target_vocab_size)  # [V]
    new_ids = draft_target_ids(torch.as_tensor(d2t_new, dtype=torch.int64))  # [N_new]
    src = old_slot[new_ids]                               # old row of each new slot, or -1
    lm_old = pub.state["lm_head.weight"]
    if lm_old.shape[0] != old_ids.numel():
        raise ValueError(f"train.init_from={pub.path}: lm_head has {lm_old.shape[0]} rows, d2t "
                         f"{old_ids.numel()}")
    lm = state["lm_head.weight"]
    keep = src >= 0
    lm[keep] = lm_old[src[keep]].to(lm.dtype)
    return state, {"carried_rows": int(keep.sum()), "fresh_rows": int((~keep).sum())}


# The drafter's decoder layer (midlayer) from the target's last one, by name. q/k/v take
# [norm(embedding) ; hidden_norm(g)] (2H inputs, drafter.py): the target's own q/k/v go to
# the hidden-state half (columns H:), the embedding half keeps its fresh initialisation.
_FROM_LAST_LAYER = {
    "midlayer.input_layernorm.weight": "input_layernorm.weight",
    "midlayer.hidden_norm.weight": "input_layernorm.weight",
    "midlayer.self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight": "mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight": "mlp.down_proj.weight",
}
_QKV = ("q_proj", "k_proj", "v_proj")


def target_init_state(target_dir: str | Path, arch, d2t, seed: int, what: str
                      ) -> tuple[dict[str, Any], list[str]]:
    """A fresh drafter's initial state with parts taken from the target (`train.init_from_target`):

        lm_head   lm_head.weight[i] = target lm_head[draft id i -> target id]; norm = target's final norm
        layer     that, and midlayer.* from the target's last decoder layer (_FROM_LAST_LAYER),
                  q/k/v_proj[:, H:] = the target's q/k/v_proj (the hidden-state half)

    Returns (state, the drafter tensor names taken from the target). Any shape that differs
    from the target's is refused, naming both (a MoE or MLA last layer has no counterpart)."""
    import torch

    from eagle_ray.model.drafter import Eagle3Drafter
    from eagle_ray.model.vocab import draft_target_ids
    from eagle_ray.targets.load import load_embed_and_lm_head, load_last_layer

    torch.manual_seed(seed)
    state = {k: v.detach().clone() for k, v in Eagle3Drafter(arch, d2t=d2t).state_dict().items()}
    suffixes = tuple(_FROM_LAST_LAYER.values()) + tuple(f"self_attn.{p}.weight" for p in _QKV)
    src = load_last_layer(target_dir, suffixes if what == "layer" else ())
    _, head = load_embed_and_lm_head(target_dir)
    plan = {"lm_head.weight": head[draft_target_ids(torch.as_tensor(d2t, dtype=torch.int64))],
            "norm.weight": src["norm.weight"]}
    H = arch.hidden_size
    if what == "layer":
        plan.update({mine: src[theirs] for mine, theirs in _FROM_LAST_LAYER.items()})
        for p in _QKV:
            name = f"midlayer.self_attn.{p}.weight"
            w = state[name].clone()
            theirs = src[f"self_attn.{p}.weight"]
            if tuple(theirs.shape) != (w.shape[0], H):
                raise ValueError(f"train.init_from_target=layer: the target's {p} is "
                                 f"{tuple(theirs.shape)}, the drafter's hidden half is {(w.shape[0], H)}")
            w[:, H:] = theirs.to(w.dtype)
            plan[name] = w
    for name, w in plan.items():
        if tuple(w.shape) != tuple(state[name].shape):
            raise ValueError(f"train.init_from_target={what}: the target's tensor for {name} is "
                             f"{tuple(w.shape)}, the drafter's is {tuple(state[name].shape)}")
        state[name] = w.to(state[name].dtype).clone()
    return state, sorted(plan)
