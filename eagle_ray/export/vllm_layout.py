"""vLLM's file layout of an EAGLE-3 drafter: tensor names and config.json.

The model (eagle_ray.model.drafter) knows nothing of how vLLM names or configures it; this
module maps an `Eagle3Drafter` onto what vLLM's `Eagle3LlamaForCausalLM` loads, and
eagle_ray.export.drafter writes it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from eagle_ray.model.drafter import DrafterArch, Eagle3Drafter

# vLLM's registry maps this (and "Eagle3LlamaForCausalLM") to llama_eagle3.Eagle3LlamaForCausalLM;
# it is also the name SpecForge writes, and EAGLEConfig keeps names ending in "Eagle3".
EXPORT_ARCHITECTURE = "LlamaForCausalLMEagle3"


_EXPORT_PARAMS = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


_LATER_LAYER_PARAMS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def export_param_names(num_layers: int = 1) -> tuple[str, ...]:
    """Tensor names of an exported drafter (SpecForge/vLLM checkpoint naming); layers after
    the first are `layers.N.*` (vLLM maps `midlayer.` to `layers.0.`; they have no
    hidden_norm: vLLM builds one per layer but only layer 0 uses it)."""
    later = tuple(f"layers.{i}.{n}" for i in range(1, num_layers) for n in _LATER_LAYER_PARAMS)
    return _EXPORT_PARAMS[:-4] + later + _EXPORT_PARAMS[-4:]


def state_dict_for_export(model: Eagle3Drafter, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors named as vLLM's ``Eagle3LlamaForCausalLM.load_weights`` reads
    them. Floating tensors are cast to ``dtype`` when given; d2t stays int64, t2d bool.
    The target embedding / lm_head are NOT included (vLLM shares the target's embedding).
    With a full draft vocabulary (N == V) d2t/t2d are left out: vLLM then builds no
    ``draft_id_to_target_id`` parameter and refuses a checkpoint that carries one."""
    sd = model.state_dict()
    names = export_param_names(model.arch.num_layers)
    if set(sd) != set(names):
        raise RuntimeError(f"unexpected drafter state: {sorted(set(sd) ^ set(names))}")
    full_vocab = model.arch.draft_vocab_size == model.arch.target_vocab_size
    out = {}
    for name in names:
        if full_vocab and name in ("d2t", "t2d"):
            continue
        t = sd[name].detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.contiguous().clone()
    return out


def _dtype_name(d: Any) -> str | None:
    if d is None:
        return None
    if isinstance(d, torch.dtype):
        return str(d).removeprefix("torch.")
    return str(d)


def vllm_config(arch: DrafterArch, target_config: Mapping[str, Any], aux_layer_ids: Sequence[int],
                *, dtype: torch.dtype | str | None = None) -> dict[str, Any]:
    """config.json for the exported drafter (vLLM: speculative method "eagle3").

    The aux layer ids are written where EVERY vLLM runner reads them: top-level
    ``eagle_aux_hidden_state_layer_ids`` (model runner V2, the CUDA default, reads only this
    or ``eagle_config["layer_ids"]`` and otherwise silently uses the target's default layers)
    and ``eagle_config["eagle_aux_hidden_state_layer_ids"]`` (the older runner, used by the CPU
    build, and llama_eagle3's fc width).

    ``architectures`` = ["LlamaForCausalLMEagle3"] (vLLM registry -> llama_eagle3.
    Eagle3LlamaForCausalLM), ``model_type`` "llama", one hidden layer, plain (default) RoPE
    with ``arch.rope_theta`` (that is what was trained), ``vocab_size`` = TARGET vocab,
    ``draft_vocab_size`` = N, ``eagle_config.eagle_aux_hidden_state_layer_ids`` = the target
    layers whose INPUT residual streams were captured, ascending (vLLM concatenates them in
    layer order, which must match the order ``fc`` was trained on).
    """
    ids = [int(i) for i in aux_layer_ids]
    if len(ids) != arch.num_aux_layers:
        raise ValueError(f"expected {arch.num_aux_layers} aux layer ids, got {ids}")
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"aux_layer_ids must be strictly increasing, got {ids}")
    if int(target_config.get("vocab_size", arch.target_vocab_size)) != arch.target_vocab_size:
        raise ValueError("target_config vocab_size != arch.target_vocab_size")
    tgt_h = int(target_config.get("hidden_size", arch.hidden_size))
    if tgt_h != arch.hidden_size:
        raise ValueError("drafter hidden_size must equal the target's (shared embedding)")
    dt = _dtype_name(dtype) or target_config.get("dtype") or target_config.get("torch_dtype") or "bfloat16"
    cfg: dict[str, Any] = {
        "architectures": [EXPORT_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "num_hidden_layers": arch.num_layers,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta},
        "max_position_embeddings": arch.max_position_embeddings,
        "vocab_size": arch.target_vocab_size,
        "draft_vocab_size": arch.draft_vocab_size,
        "target_hidden_size": tgt_h,
        "eagle_aux_hidden_state_layer_ids": ids,
        "tie_word_embeddings": False,
        "dtype": dt,
        "torch_dtype": dt,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": ids,
            "use_aux_hidden_state": True,
        },
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if target_config.get(key) is not None:
            cfg[key] = target_config[key]
    return cfg
