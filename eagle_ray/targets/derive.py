"""A recipe derived from a checkpoint directory: `eagle-ray recipes --from-target DIR`, and
`--recipe DIR` (or `--recipe auto --set target.path=DIR`) on every command.

For a target no built-in recipe names. Reads only config.json and the weight files' sizes
(no weight is loaded), so it answers in a second for any size:

    target    architecture = architectures[0]; the text model's (text_config of a
              multimodal wrapper) hidden_size, num_hidden_layers, vocab_size,
              num_attention_heads, intermediate_size (the dense MLP width: a MoE's
              routed experts have their own); aux layers by the default rule (2, L//2, L-3)
    drafter   one Llama decoder layer shaped like the target's: its attention heads, KV heads
              (num_key_value_heads) and head width (head_dim when it is the attention's:
              hidden / heads otherwise); MLP width, rope and norm eps come from the target
              config at build time (train/run.drafter_arch); draft vocabulary
              min(32,000, vocab) and 7 TTT steps (the published drafters') on a GPU; on the
              CPU min(8,192, vocab) and 1 TTT step, which the defaults study measured best
              at a CPU's training budget on the real target (README, "The defaults study":
              at equal training time 8,192 beats 32,000 by 0.10, and 1 step beats 3 by 0.07
              as served; a constant learning rate after warmup, +0.02 over cosine);
              training keeps the most frequent
              target tokens of the data (model/vocab.py), so a vocabulary smaller than that
              is the data's to fill
    engine    GPU: tensor parallel = the smallest power of two whose GPUs hold the weights
              with the KV cache's share of memory left over, 8 // TP replicas a node, and a
              whole-node target (TP 8) colocated (one engine generates, then captures); CPU
              (no GPU here): fp32, eager, a fixed 64 MiB KV cache, chunked prefill off (the
              CPU recipes' engine), CPU_MLA pinned for an MLA target; a multimodal wrapper
              (text_config) served text-only (language_model_only)
    the rest  the built-in recipes' defaults (tiny_cpu's schedule on the CPU)

`remote_code`: an `auto_map` in the tokenizer or model config names custom code; the derived
recipe still leaves trust_remote_code off (only the user turns it on).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from eagle_ray.config import (DrafterConfig, EngineConfig, ExtractConfig, GenerateConfig, Recipe,
                              TargetConfig, TrainConfig)

AUTO = "auto"
MAX_DRAFT_VOCAB = 32000
# On the CPU (hours of training on a few cores), measured on SmolLM2-135M by
# bench/study_defaults.py at equal training time: 8,192 beats 32,000 by ~0.10 acceptance,
# and 1 TTT step (half a step's cost: twice the steps) beats 3 by +0.03 greedy and +0.07
# as served at two budgets; 3 and more pay at later draft positions only with far more
# training than a CPU gives (the GPU recipes keep 7).
CPU_DRAFT_VOCAB = 8192
CPU_TTT_STEPS = 1
# ... and a constant learning rate after warmup beats cosine (and linear) decay to 10% there:
# +0.02 as served at 50 and at 100 steps (a short run is far from the end decay helps at).
CPU_LR_SCHEDULE = "constant"


def is_target_dir(name: str) -> bool:
    """Does a --recipe value name a checkpoint directory (rather than a built-in recipe)?"""
    return ("/" in name or name.startswith(".")) and (Path(name) / "config.json").is_file()


def _weights_bytes(d: Path) -> int:
    return sum(f.stat().st_size for pat in ("*.safetensors", "*.bin") for f in d.glob(pat))


def _gpu_memory_bytes() -> int | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory
    except Exception:  # no torch CUDA here: a CPU machine
        return None
    return None


def tensor_parallel_for(weights_bytes: int, gpu_bytes: int, utilization: float = 0.9,
                        kv_share: float = 0.3) -> int:
    """The smallest power of two (<= 8) of GPUs whose memory holds the weights and leaves
    `kv_share` of what vLLM may use for the KV cache; 8 when nothing smaller does."""
    tp = 1
    while tp < 8 and weights_bytes > tp * gpu_bytes * utilization * (1 - kv_share):
        tp *= 2
    return tp


def recipe_from_target(model_dir: str | Path, cpu_base: Recipe, *, gpu_bytes: int | None = -1) -> Recipe:
    """The recipe for the checkpoint in `model_dir` (see the module docstring); `cpu_base`:
    the recipe whose engine, pools and schedule a CPU machine uses (recipes.tiny_cpu).
    `gpu_bytes`: one GPU's memory (-1: ask torch; None: a CPU machine)."""
    d = Path(model_dir)
    path = d / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} is missing: --recipe DIR needs a Hugging Face model directory")
    cfg = json.loads(path.read_text())
    text = cfg.get("text_config") or cfg
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                           "intermediate_size") if not isinstance(text.get(k), int)]
    if missing:
        raise ValueError(f"{path} does not give {', '.join(missing)}: not a decoder model eagle_ray "
                         "knows how to read; write a recipe for it")
    arch = (cfg.get("architectures") or [None])[0]
    if not arch:
        raise ValueError(f"{path} names no architectures: set it (e.g. [\"LlamaForCausalLM\"])")
    heads, hidden = text["num_attention_heads"], text["hidden_size"]
    # A config's head_dim is the attention's own for Llama/Qwen/Mistral; DeepSeek-V3-style MLA
    # (kv_lora_rank) writes its rope width there, which is no Llama layer's head width.
    head_dim = text.get("head_dim") if "kv_lora_rank" not in text else None
    head_dim = head_dim or hidden // heads
    kv_heads = text.get("num_key_value_heads") or heads
    if "kv_lora_rank" in text:
        kv_heads = heads  # MLA: every head has its own keys; the Llama drafter layer alike
    target = TargetConfig(path=str(d.resolve()), architecture=arch, hidden_size=hidden,
                          num_layers=text["num_hidden_layers"], vocab_size=text["vocab_size"],
                          num_attention_heads=heads, intermediate_size=text["intermediate_size"])
    drafter = DrafterConfig(draft_vocab_size=min(MAX_DRAFT_VOCAB, text["vocab_size"]),
                            num_key_value_heads=kv_heads, head_dim=head_dim)
    gpu = _gpu_memory_bytes() if gpu_bytes == -1 else gpu_bytes
    base = cpu_base
    r = dataclasses.replace
    # A multimodal wrapper is served text-only: EAGLE-3 drafts text (as the Kimi recipes).
    text_only = "text_config" in cfg or "vision_config" in cfg
    mla = "kv_lora_rank" in text
    if gpu is None:  # the CPU recipes' engine, pools and schedule
        engine = r(base.engine, language_model_only=text_only,
                   attention_backend="CPU_MLA" if mla else None)  # as tiny_kimi_cpu pins it
        drafter = r(drafter, draft_vocab_size=min(CPU_DRAFT_VOCAB, text["vocab_size"]),
                    ttt_steps=CPU_TTT_STEPS)
        return r(base, name=AUTO, target=target, drafter=drafter, engine=engine,
                 train=r(base.train, lr_schedule=CPU_LR_SCHEDULE))
    tp = tensor_parallel_for(_weights_bytes(d), gpu)
    whole_node = tp == 8  # one engine per node generates, then captures (colocated)
    return Recipe(name=AUTO, target=r(target, tensor_parallel_size=tp), drafter=drafter,
                  engine=EngineConfig(language_model_only=text_only),
                  generate=GenerateConfig(gpus_per_replica=tp, min_replicas=1, max_replicas=8 // tp),
                  extract=ExtractConfig(backend="vllm", gpus_per_replica=tp, min_replicas=1,
                                        max_replicas=8 // tp,
                                        placement="colocated" if whole_node else "separate",
                                        prefix_caching=whole_node),
                  train=TrainConfig())


def auto_path(overrides: dict[str, str]) -> str:
    """`--recipe auto`: the checkpoint named by `--set target.path=DIR`."""
    path = overrides.get("target.path")
    if not path:
        raise ValueError("--recipe auto needs the checkpoint: --set target.path=DIR (or give the "
                         "directory itself: --recipe DIR)")
    return path
