"""A tiny twin of Kimi-K2.5: the real checkpoint's file layout and architecture, tiny numbers.

Kimi-K2.5 (the production target) is not a Llama: it is a multimodal wrapper
(`KimiK25ForConditionalGeneration`, config `model_type` "kimi_k25") around a DeepSeek-V3
text model (MLA attention, MoE with routed + shared experts, sigmoid routing with a score
correction bias), with every language-model weight stored under `language_model.*`.
Each of those differences is a place where loading, capture, serving or the HF reference
can go wrong, so the project builds a twin that has all of them and runs the whole
pipeline on it on the CPU (recipe `tiny_kimi_cpu`).

What the twin copies from the real checkpoint (config.json of moonshotai/Kimi-K2.5):

    config.json                 architectures ["KimiK25ForConditionalGeneration"], model_type
                                "kimi_k25", media_placeholder_token_id, use_unified_vision_chunk,
                                video_placeholder, tie_word_embeddings false, vision_config (the
                                real tower's shape; see below),
      text_config               model_type "deepseek_v3", architectures ["DeepseekV3ForCausalLM"],
                                MLA (q_lora_rank, kv_lora_rank, qk_nope/qk_rope/v head dims),
                                MoE (n_routed_experts, n_shared_experts, num_experts_per_tok,
                                moe_intermediate_size, first_k_dense_replace, moe_layer_freq,
                                n_group/topk_group, routed_scaling_factor 2.827, norm_topk_prob,
                                scoring_func "sigmoid", topk_method "noaux_tc"), yarn rope
                                (rope_scaling with factor/mscale/mscale_all_dim, rope_theta 50000)
    model-0000N-of-0000M.safetensors + model.safetensors.index.json
                                language_model.model.embed_tokens.weight, language_model.model.
                                layers.{i}.self_attn.{q_a_proj,q_a_layernorm,q_b_proj,
                                kv_a_proj_with_mqa,kv_a_layernorm,kv_b_proj,o_proj}.weight,
                                layers.0.mlp.{gate,up,down}_proj (dense), layers.{i>=1}.mlp.
                                experts.{e}.{gate,up,down}_proj.weight (one tensor per expert, as
                                on disk; transformers fuses them in memory), mlp.gate.weight,
                                mlp.gate.e_score_correction_bias (float32), mlp.shared_experts.*,
                                language_model.model.norm.weight, language_model.lm_head.weight;
                                embedding/norm/lm_head in the last shard, as in the real one
    preprocessor_config.json    {"media_proc_cfg": {...}} (the real values): vLLM builds the
                                Kimi media processor whenever it loads the class, even with
                                language_model_only ("Can't load image processor" without it)

What differs, and why:
  * Numbers: hidden 128, 8 layers, 4 heads, 4 routed + 1 shared experts, top-2, vocab 1024,
    float32, 1024 positions (yarn factor 4 over 256 original positions instead of 64 over
    4096). kv_lora_rank 512 and qk_rope_head_dim 64 stay the real values: vLLM's CPU MLA
    backend only supports the latent head size 512 + 64 = 576.
  * No vision weights (vision_tower.*, mm_projector.*). Engines run with
    `language_model_only=True`, under which vLLM replaces the vision tower and projector with
    placeholders that are neither built nor loaded (`SupportsMultiModal._mark_tower_model`),
    so the tower's shape in vision_config is never used beyond one number
    (`vision_config.num_attention_heads`, read before the tower is skipped). The twin must be
    served with language_model_only (both Kimi recipes set it): without it vLLM would build
    a real-size vision tower for which the twin has no weights.
  * The tokenizer is the tiny Llama's (`eagle_ray.targets.tiny.target`), copied file for file,
    so both tiny targets tokenize identically and share corpus stats. Its chat template is
    the tiny Llama's for text (ChatML turns) and Kimi-K2.5's for tools: a `tool_declare`
    turn, tool-call sections with `functions.NAME:IDX` ids, "## Return of ID" results
    (`_kimi_chat_template`; the markers are plain text, not added tokens).
    It has no "<|media_pad|>" token; media_placeholder_token_id (and image_token_id, the
    name transformers' Kimi_K25Config and vLLM read; on the real checkpoint it defaults to
    the same id) is 1023, an id of the embedding table the tokenizer never produces, as the
    real media token is a reserved id the text never contains.
  * No quantization_config (the real experts are int4 compressed-tensors), no auto_map and
    no remote-code files: transformers >= 5.16 and vLLM ship the Kimi-K2.5 config classes,
    so nothing here ever needs trust_remote_code.
  * rope_interleave is not written (as in the real file): transformers' DeepseekV3 then
    reads the rope dims interleaved, which is the checkpoint convention vLLM's DeepSeek-V2/V3
    model also assumes (is_neox_style=False).

Weights are trained briefly (like the tiny Llama) on chat-formatted corpus conversations so
greedy continuations are sentences, not one repeated token; the routing bias
e_score_correction_bias is seeded non-zero so routing with and without the bias differs.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# Bump when anything below changes what gets built, so caches rebuild.
KIMI_VERSION = 2  # 2: its own chat template, rendering tools the way Kimi-K2.5's does
CACHE_NAME = "tiny-kimi"

# The real Kimi-K2.5 values where the CPU allows them, tiny numbers elsewhere.
KIMI_TEXT_ARCH = dict(
    hidden_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
    intermediate_size=256,  # the dense layer(s) before first_k_dense_replace
    moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1,
    routed_scaling_factor=2.827, norm_topk_prob=True,
    q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
    vocab_size=1024, max_position_embeddings=1024,
)
ROPE_THETA = 50000.0
ROPE_SCALING = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
MEDIA_PLACEHOLDER_ID = 1023

# The real checkpoint's vision tower description (remote-code schema), except the text width.
# Never instantiated: engines run language_model_only (see the module docstring).
VISION_CONFIG = {
    "init_pos_emb_height": 64, "init_pos_emb_time": 4, "init_pos_emb_width": 64,
    "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_hidden_size": 1152,
    "mm_projector_type": "patchmerger", "model_type": "", "patch_size": 14,
    "pos_emb_type": "divided_fixed", "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
    "text_hidden_size": KIMI_TEXT_ARCH["hidden_size"], "video_attn_type": "spatial_temporal",
    "vt_hidden_size": 1152, "vt_intermediate_size": 4304, "vt_num_attention_heads": 16,
    "vt_num_hidden_layers": 27,
}
# preprocessor_config.json of the real checkpoint: the media processor's settings.
MEDIA_PROC_CFG = {
    "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": 2, "fixed_output_tokens": None,
    "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 4096,
    "in_patch_limit_video": None, "sample_fps": 2.0, "max_num_frames_each_video": None,
    "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")

def _kimi_chat_template() -> str:
    """The tiny Llama's ChatML turns (the twin is trained on them) with Kimi-K2.5's tool
    syntax: the tools declared in a `tool_declare` turn as compact JSON, before the system
    prompt; calls after the turn's text in a tool-calls section, each as
    <|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|> (Kimi's ids are
    `functions.NAME:IDX`); each result as a `tool` turn opening "## Return of ID". Kimi's
    markers are plain text here (the tiny vocabulary has no room for them as tokens)."""
    from eagle_ray.targets.tiny.target import turns_template

    return turns_template(
        tool_declaration=("{{ '<|im_start|>tool_declare\\n' + (tools | tojson(separators=(',', ':')))"
                          " + '<|im_end|>\\n' }}"),
        tool_call=("{{ '<|tool_calls_section_begin|>' }}"
                   "{%- for tc in message['tool_calls'] -%}"
                   "{{ '<|tool_call_begin|>' + tc['id'] + '<|tool_call_argument_begin|>'"
                   " + (tc['function']['arguments'] | tojson) + '<|tool_call_end|>' }}"
                   "{%- endfor -%}"
                   "{{ '<|tool_calls_section_end|>' }}"),
        tool_result=("{{ '<|im_start|>tool\\n## Return of ' + message['tool_call_id'] + '\\n'"
                     " + (message['content'] or '') + '<|im_end|>\\n' }}"),
        system_in_declaration=False)


WEIGHT_PREFIX = "language_model."
NUM_SHARDS = 2


def text_config_dict(eos_id: int, pad_id: int) -> dict:
    """`text_config` as the real config.json spells it (DeepSeek-V3 keys, hub style rope)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        **KIMI_TEXT_ARCH,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",  # vLLM defaults to softmax
        "seq_aux": True, "aux_loss_alpha": 0.001, "ep_size": 1, "num_nextn_predict_layers": 0,
        "hidden_act": "silu", "rms_norm_eps": 1e-05, "initializer_range": 0.02,
        "attention_bias": False, "attention_dropout": 0.0, "use_cache": True,
        "rope_theta": ROPE_THETA, "rope_scaling": dict(ROPE_SCALING),
        "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": eos_id,
        "pad_token_id": pad_id, "dtype": "float32", "torch_dtype": "float32",
    }


def wrapper_config_dict(eos_id: int, pad_id: int) -> dict:
    """The top-level config.json (KimiK25ForConditionalGeneration around the text config)."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": pad_id,
        "dtype": "float32", "torch_dtype": "float32", "ignore_index": -100,
        "media_placeholder_token_id": MEDIA_PLACEHOLDER_ID,
        "image_token_id": MEDIA_PLACEHOLDER_ID,
        "text_config": text_config_dict(eos_id, pad_id),
        "tie_word_embeddings": False,  # transformers' Kimi_K25Config defaults to True
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "vision_config": dict(VISION_CONFIG),
    }


def to_checkpoint_state(hf_state: dict) -> dict:
    """transformers DeepseekV3ForCausalLM state dict -> the Kimi checkpoint's tensors.

        model.X                                  -> language_model.model.X
        lm_head.weight                           -> language_model.lm_head.weight
        ...mlp.experts.gate_up_proj [E, 2I, H]   -> ...mlp.experts.{e}.gate_proj.weight [I, H]
                                                    ...mlp.experts.{e}.up_proj.weight   [I, H]
        ...mlp.experts.down_proj    [E, H, I]    -> ...mlp.experts.{e}.down_proj.weight [H, I]

    (transformers fuses the per-expert tensors on load, gate rows first; the file keeps one
    tensor per expert, which is what vLLM and the real checkpoint use.)
    """
    out = {}
    for name, t in hf_state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{WEIGHT_PREFIX}{base}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{WEIGHT_PREFIX}{base}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{WEIGHT_PREFIX}{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[WEIGHT_PREFIX + name] = t.contiguous()
    return out


def _save_sharded(state: dict, out: Path) -> None:
    """Decoder layers in the first shards, embedding/norm/lm_head in the last (as Kimi does),
    plus model.safetensors.index.json mapping every tensor name to its file."""
    from safetensors.torch import save_file

    layer_names = sorted(n for n in state if ".layers." in n)
    other = sorted(n for n in state if ".layers." not in n)
    per = -(-len(layer_names) // (NUM_SHARDS - 1))
    groups = [layer_names[i * per:(i + 1) * per] for i in range(NUM_SHARDS - 1)] + [other]
    weight_map, total = {}, 0
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{NUM_SHARDS:05d}.safetensors"
        save_file({n: state[n] for n in names}, str(out / fname), metadata={"format": "pt"})
        for n in names:
            weight_map[n] = fname
            total += state[n].numel() * state[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _training_stream(tokenizer, seed: int):
    """Chat-formatted corpus conversations as one token stream (what the tiny Llama learns)."""
    import torch

    from eagle_ray.targets.tiny import corpus

    texts = tokenizer.apply_chat_template(corpus.conversations(4000, seed=seed), tokenize=False)
    ids = [i for row in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in row]
    return torch.tensor(ids, dtype=torch.long)


def build_tiny_kimi(out_dir: str | Path, *, seed: int = 0, train_steps: int = 160,
                    batch_size: int = 16, seq_len: int = 128,
                    tokenizer_dir: str | Path | None = None) -> dict:
    """Build the twin into out_dir (must not exist or be empty). Returns build stats.

    tokenizer_dir: where to copy the tokenizer from (default: the cached tiny Llama, built
    on first use).
    """
    import torch
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    from eagle_ray.targets.tiny.target import ensure_tiny_target, train_briefly

    t0 = time.time()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_src = Path(tokenizer_dir) if tokenizer_dir else ensure_tiny_target()
    for name in TOKENIZER_FILES:
        if (tok_src / name).exists():
            shutil.copyfile(tok_src / name, out / name)
    template = _kimi_chat_template()
    (out / "chat_template.jinja").write_text(template)
    tc_path = out / "tokenizer_config.json"
    tc_path.write_text(json.dumps({**json.loads(tc_path.read_text()), "chat_template": template}, indent=2))
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) <= MEDIA_PLACEHOLDER_ID, len(tok)  # the placeholder id is never produced
    eos_id, pad_id = tok.eos_token_id, tok.pad_token_id

    torch.manual_seed(seed)
    tcfg = text_config_dict(eos_id, pad_id)
    hf_cfg = DeepseekV3Config(**{k: v for k, v in tcfg.items() if k != "architectures"})
    model = DeepseekV3ForCausalLM(hf_cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a non-zero routing bias: selection differs from plain top-k
        for layer in model.model.layers[hf_cfg.first_k_dense_replace:]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(0.05 * torch.randn(bias.shape, generator=gen))

    data = _training_stream(tok, seed)
    loss_val = train_briefly(model, data, gen, train_steps=train_steps, batch_size=batch_size,
                             seq_len=seq_len, label="tiny kimi")

    state = model.state_dict()
    for name, t in state.items():  # the router's correction bias is float32 in the real one
        if name.endswith("e_score_correction_bias"):
            state[name] = t.float()
    _save_sharded(to_checkpoint_state(state), out)
    (out / "config.json").write_text(json.dumps(wrapper_config_dict(eos_id, pad_id), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos_id, "pad_token_id": pad_id}, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(
        {"media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n")
    stats = {"version": KIMI_VERSION, "seed": seed, "train_steps": train_steps,
             "final_loss": loss_val, "tokens_in_corpus": len(data),
             "num_parameters": sum(p.numel() for p in model.parameters()),
             "build_seconds": round(time.time() - t0, 2)}
    (out / "eagle_ray_tiny.json").write_text(json.dumps(stats, indent=2))
    return stats


def ensure_tiny_kimi(cache_dir: str | Path | None = None) -> Path:
    """The cached twin directory, built on first use (safe across processes); what the
    `tiny_kimi_cpu` recipe's target path "tiny-kimi" resolves to."""
    from eagle_ray.targets.tiny.target import ensure_built

    return ensure_built(CACHE_NAME, KIMI_VERSION, build_tiny_kimi, cache_dir)
