"""Capture EAGLE-3 training features from real vLLM (prefill only), on CPU or CUDA.

Contract, per token of a token-id sequence of length T (H = the target's hidden size):

  aux   [T, len(aux_layer_ids) * H]  for each i in aux_layer_ids (ascending), the residual
                                     stream ENTERING decoder layer i: HF
                                     `output_hidden_states=True` -> `hidden_states[i]`
                                     (hidden_states[0] is the embedding output)
  final [T, H]                       the last decoder layer's output AFTER the final norm,
                                     so `lm_head(final)` are the target's logits (= HF
                                     `hidden_states[-1]`, which transformers 5.x records
                                     post-norm for Llama)

How. vLLM's `extract_hidden_states` speculative method makes the target return the
residual streams at the configured layer indices (`EagleModelMixin._maybe_add_hidden_state`:
index i < L is the stream entering layer i, index L the stream leaving the last layer,
BEFORE the final norm) and writes them, for every scheduled token, into a cache-only
"KV cache" layer. A hidden-states KV connector reads a finished request's blocks out of
that cache. vLLM has no capture point for the post-norm state (the model applies
`self.norm` after its last capture point and hands the result only to the sampler), so we
also capture index L and the connector applies the target's own final-norm module (the one
vLLM loaded, on its device, in the model dtype) to it in the worker. A worker extension
(`CaptureWorkerExtension`, called once by name, which needs no pickled code) gives the
connector that module.

The stock `ExampleHiddenStatesConnector` copies device->host on a side CUDA stream into
pinned memory and writes files from a thread pool: on the CPU build that crashes
(multiprocess engine) or hangs (in-process engine). `SyncHiddenStatesConnector` replaces
only that save with a synchronous one, which works on CPU and CUDA.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence

import torch
from safetensors.torch import load_file, save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

_WAIT_TIMEOUT_S = 600.0
NO_CAPTURE_KEY = "eagle_ray_no_capture"


def no_capture(params):
    """`SamplingParams` for a request the capture engine should run WITHOUT saving its
    states (generation in the colocated stage): the connector skips it (request_finished)."""
    extra = dict(params.extra_args or {})
    extra["kv_transfer_params"] = {**extra.get("kv_transfer_params", {}), NO_CAPTURE_KEY: True}
    params.extra_args = extra
    return params


class _CopyDone:
    """Stands in for the parent's per-request `torch.cuda.Event`: our copy has already
    finished when it is recorded, so the inherited `get_finished` reports the request
    done (and its blocks free) in the same step."""

    @staticmethod
    def query() -> bool:
        return True


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous, device-agnostic save.

    Inherited unchanged: the scheduler side (which blocks hold a finished request's states;
    they stay allocated until saved) and `get_finished`. Replaced: the worker-side save.
    It gathers the request's slots from the hidden-states cache, applies the final norm to
    the last captured index if `final_norm` was installed, copies to the CPU with a plain
    blocking `.to("cpu")` (no CUDA stream, event or pinned memory, so it runs on the CPU
    build; on CUDA the step waits for this small device->host copy), and writes the file
    under a temporary name then renames it, so a reader that sees the file sees all of it
    (hence no flock protocol: run with use_synchronization_lock=False). Only TP rank 0
    writes (every rank's cache holds the full states), as upstream.
    """

    final_norm: torch.nn.Module | None = None  # set by CaptureWorkerExtension

    def request_finished(self, request, block_ids):
        """Scheduler side: a request sent with `NO_CAPTURE` (generation in the colocated
        stage) frees its blocks at once and saves nothing; every other request as upstream."""
        if (request.kv_transfer_params or {}).get(NO_CAPTURE_KEY):
            self._request_filenames.pop(request.request_id, None)
            self._pending_saves.pop(request.request_id, None)
            return False, None
        return super().request_finished(request, block_ids)

    def _submit_async_write(self, pending: PendingSave) -> None:  # name kept: parent calls it
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(  # [num_tokens, num_captured, H] on the device
            self._kv_cache, slot_mapping.to(self._kv_cache.device), num_tokens)
        tensors = {"token_ids": pending.token_ids.clone()}
        if self.final_norm is not None:
            with torch.inference_mode():
                final = self.final_norm(hidden[:, -1].contiguous())
            tensors["final_hidden_states"] = final.to("cpu")
            hidden = hidden[:, :-1]
        tensors["hidden_states"] = hidden.to("cpu").contiguous()  # blocking copy
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        part = pending.filename + ".part"
        save_file(tensors, part)
        os.replace(part, pending.filename)  # atomic: readers never see a partial file
        # The inherited get_finished polls this per-request "event" to report the request
        # done (its blocks are then freed).
        self._req_copy_events[pending.req_id] = _CopyDone()


class CaptureWorkerExtension:
    """Mixed into each vLLM worker (`worker_extension_cls`); called by name through
    `LLM.collective_rpc`, so it works with a multiprocess engine without pickled code."""

    def eagle_ray_install_final_norm(self, storage_path: str) -> str:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        model = self.get_model()
        lm = model.get_language_model() if hasattr(model, "get_language_model") else model
        norm = getattr(getattr(lm, "model", lm), "norm", None)
        if not isinstance(norm, torch.nn.Module):
            raise ValueError(f"cannot find the final norm of {type(model).__name__} "
                             "(looked for <language model>.model.norm)")
        # The worker-side connector is a process global that vLLM creates only once: a
        # second in-process engine in the same process would silently share the first
        # one's (and read the wrong cache). Refuse that.
        connector = get_kv_transfer_group()
        if (not isinstance(connector, SyncHiddenStatesConnector)
                or connector._storage_path != storage_path):  # noqa: SLF001 (our subclass's base)
            raise RuntimeError("this worker's KV connector belongs to another engine: close "
                               "the other in-process VllmCapture/vLLM engine first")
        connector.final_norm = norm
        return type(norm).__name__


def transfer_dir() -> str | None:
    """Where the connector's per-request state files pass (written by vLLM's worker, read and
    deleted by `capture` at once): a RAM-backed /dev/shm when there is one with room (the
    states never touch a disk, and no disk I/O is paid), else the system temp directory.
    EAGLE_RAY_CAPTURE_DIR overrides."""
    forced = os.environ.get("EAGLE_RAY_CAPTURE_DIR")
    if forced:
        return forced
    try:
        if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free >= 2 << 30:
            return "/dev/shm"
    except OSError:
        pass
    return None


def _sweep_stale(base: str) -> None:
    """Remove transfer directories of processes that are gone (an actor killed by Ray never
    runs its cleanup); the name carries the owner's pid."""
    import glob

    for d in glob.glob(os.path.join(base, "eagle_ray_vcap_*_*")):
        try:
            pid = int(os.path.basename(d).split("_")[3])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, IndexError, PermissionError, OSError):
            continue


class VllmCapture:
    """A vLLM engine that returns EAGLE-3 features for token-id sequences (see module doc).

    `engine_kwargs`: extra `vllm.LLM` kwargs (dtype, enforce_eager, kv_cache_memory_bytes,
    max_model_len, tensor_parallel_size, ...). We set `speculative_config`,
    `kv_transfer_config` and `worker_extension_cls`, and default `enable_prefix_caching`
    to False (True is allowed: a cached prefix's blocks of the hidden-states cache are
    shared too and hold that prefix's states; tested on CPU). Each sequence needs
    `len(seq) + 1 <= max_model_len` (vLLM samples one token). `capture()` may be called
    repeatedly, not concurrently from several threads. `close()` (or `with`) shuts the
    engine down and removes the temporary directory the states pass through.
    """

    def __init__(self, model_path: str, aux_layer_ids: Sequence[int], engine_kwargs: dict):
        from transformers import AutoConfig
        from vllm import LLM
        from vllm.distributed.kv_transfer import has_kv_transfer_group
        from vllm.v1.engine.core_client import InprocClient

        kw = dict(engine_kwargs)
        for key in ("model", "speculative_config", "kv_transfer_config",
                    "worker_extension_cls"):
            if key in kw:
                raise ValueError(f"engine_kwargs may not set {key!r}: VllmCapture sets it")
        hf_cfg = AutoConfig.from_pretrained(
            model_path, revision=kw.get("revision"),
            trust_remote_code=kw.get("trust_remote_code", False))
        num_layers = hf_cfg.get_text_config().num_hidden_layers
        ids = sorted(int(i) for i in aux_layer_ids)
        if not ids or len(set(ids)) != len(ids) or ids[0] < 0 or ids[-1] >= num_layers:
            raise ValueError(f"aux_layer_ids must be distinct ids in [0, {num_layers}), "
                             f"got {list(aux_layer_ids)}")
        self.aux_layer_ids = tuple(ids)
        self.num_layers = num_layers

        if has_kv_transfer_group():  # see eagle_ray_install_final_norm
            raise RuntimeError("an in-process vLLM engine with a KV connector is alive in this "
                               "process: close it before building a VllmCapture")
        base = transfer_dir()
        _sweep_stale(base or tempfile.gettempdir())
        self._dir = tempfile.mkdtemp(prefix=f"eagle_ray_vcap_{os.getpid()}_", dir=base)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True)
        kw.setdefault("enable_prefix_caching", False)
        kw.update(
            model=model_path,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,  # the only value the method accepts
                # vLLM captures these in ascending order; index L (the last layer's
                # output, pre-norm) becomes `final` in the connector.
                "draft_model_config": {"hf_config": {
                    "eagle_aux_hidden_state_layer_ids": ids + [num_layers]}},
            },
            kv_transfer_config={
                "kv_connector": SyncHiddenStatesConnector.__name__,
                "kv_connector_module_path": __name__,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self._dir,
                                              "use_synchronization_lock": False},
            },
            worker_extension_cls=f"{__name__}.{CaptureWorkerExtension.__name__}",
        )
        try:
            self.llm = LLM(**kw)
            self.llm.collective_rpc("eagle_ray_install_final_norm", args=(self._dir,))
        except BaseException:
            self.close()
            raise
        # An in-process engine runs only when stepped: after `generate` returns, the step
        # that saves the last finished requests has not run yet, so `_wait` steps it. A
        # multiprocess engine core keeps stepping on its own while saves are pending.
        self._inproc = isinstance(self.llm.llm_engine.engine_core, InprocClient)

    def capture(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (aux [T, len(aux)*H], final [T, H]) float32 CPU pair per sequence, in order."""
        from vllm import SamplingParams

        if not sequences:
            return []
        if any(len(s) == 0 for s in sequences):
            raise ValueError("empty sequence")
        # One greedy token: the prefill is the forward pass that fills the hidden-states
        # cache; the connector saves the prompt tokens' slots once the request finishes.
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": [int(t) for t in s]} for s in sequences],
                                 params, use_tqdm=False)
        paths = [o.kv_transfer_params["hidden_states_path"] for o in outs]
        results = []
        try:
            for seq, path in zip(sequences, paths):
                self._wait(path)
                data = load_file(path, device="cpu")
                if data["token_ids"].tolist() != [int(t) for t in seq]:
                    raise RuntimeError(f"{path} holds the states of another sequence")
                hs = data["hidden_states"].to(torch.float32)  # [T, n_aux, H]
                final = data["final_hidden_states"].to(torch.float32)  # [T, H]
                results.append((hs.reshape(hs.shape[0], -1), final))
        finally:  # also after an error; close() removes any file written later
            for path in paths:
                if os.path.exists(path):
                    os.remove(path)
        return results

    def _wait(self, path: str) -> None:
        deadline = time.monotonic() + _WAIT_TIMEOUT_S
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM did not write {path}")
            if self._inproc:
                self.llm.llm_engine.step()  # runs the connector's save on the worker
            else:
                time.sleep(0.002)

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            shutdown = getattr(llm.llm_engine.engine_core, "shutdown", None)
            if shutdown is not None:
                shutdown()
        self._cleanup()

    def __enter__(self) -> VllmCapture:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
