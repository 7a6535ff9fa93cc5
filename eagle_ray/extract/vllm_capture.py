"""Capture EAGLE-3 training features from real vLLM (prefill only), CPU or CUDA.

Contract, per token of a token-id sequence of length T (H = target hidden size):

  aux   [T, len(aux_layer_ids) * H]  the residual stream ENTERING decoder layer i, for each i
                                     in aux_layer_ids (ascending): HF `output_hidden_states`
                                     `hidden_states[i]` (hidden_states[0] = embedding output)
  final [T, H]                       the last decoder layer's output AFTER the final norm, so
                                     `lm_head(final)` are the target's logits (= HF
                                     `hidden_states[-1]`, which transformers 5.x records
                                     post-norm for Llama)

How: vLLM's `extract_hidden_states` speculative method makes the target return the aux
residual streams of the configured layers (`EagleModelMixin._maybe_add_hidden_state`,
recorded at layer indices 0..L where index i is the stream entering layer i and index L is
the stream leaving the last layer) and writes them, for every scheduled token, into a
cache-only "KV cache" layer; a hidden-states KV connector reads a finished request's
blocks out of that cache. We add layer L to the ids vLLM captures and apply the target's
own final norm (the module vLLM loaded) to it on the CPU, because vLLM has no hook for
the post-norm state itself: the model's `forward` applies `self.norm` after the last aux
point and hands the normed states only to the sampler, never to the drafter/connector.

The stock `ExampleHiddenStatesConnector` copies device->host on a side CUDA stream into
pinned memory and writes files from a thread pool; on the CPU build that crashes
(multiprocess engine) or hangs (in-process engine). `SyncHiddenStatesConnector` below
replaces only that copy with a synchronous one, which works on CPU and CUDA.
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

CONNECTOR_NAME = "SyncHiddenStatesConnector"
_WAIT_TIMEOUT_S = 600.0


class _CopyDone:
    """Stands in for the parent's per-request `torch.cuda.Event`: our copy is already
    finished when it is recorded, so `get_finished` reports the request done at once."""

    @staticmethod
    def query() -> bool:
        return True


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous, device-agnostic save.

    The scheduler side (which blocks belong to a finished request, holding them until they
    are saved) and `get_finished` are inherited unchanged. Only the worker-side save is
    replaced: gather the request's slots from the hidden-states cache, copy them to the
    CPU with a plain blocking `.to("cpu")` (no CUDA stream, event or pinned memory, so
    it runs on the CPU build; on CUDA the step waits for that small device->host copy),
    and write the file under a temporary name then rename it, so a reader that sees the
    file sees it whole (no flock protocol needed: run with use_synchronization_lock=False).
    Only TP rank 0 writes (the cache holds full hidden states on every rank), as upstream.
    """

    def _submit_async_write(self, pending: PendingSave) -> None:  # name kept: parent calls it
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(
            self._kv_cache, slot_mapping.to(self._kv_cache.device), num_tokens
        ).to("cpu")  # blocking copy: [num_tokens, num_aux, H]
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        part = pending.filename + ".part"
        save_file({"hidden_states": hidden.contiguous(),
                   "token_ids": pending.token_ids.clone()}, part)
        os.replace(part, pending.filename)  # atomic: readers never see a partial file
        self._req_copy_events[pending.req_id] = _CopyDone()


def _final_norm_on_cpu(model: torch.nn.Module) -> torch.nn.Module:
    """Run inside the vLLM worker (`LLM.apply_model`): a float32 CPU copy of the target's
    final norm, the module applied after the last decoder layer."""
    import copy

    lm = model.get_language_model() if hasattr(model, "get_language_model") else model
    inner = getattr(lm, "model", lm)
    norm = getattr(inner, "norm", None)
    if norm is None:
        raise ValueError(f"cannot find the final norm of {type(model).__name__} "
                         "(looked for <language model>.model.norm)")
    return copy.deepcopy(norm).to(device="cpu", dtype=torch.float32).eval()


class VllmCapture:
    """A vLLM engine that returns EAGLE-3 features for token-id sequences (see module doc).

    `engine_kwargs` are extra `vllm.LLM` kwargs (dtype, enforce_eager, kv_cache_memory_bytes,
    max_model_len, tensor_parallel_size, ...). We set `speculative_config`,
    `kv_transfer_config` and `enable_prefix_caching=False` ourselves. Each sequence needs
    `len(seq) + 2 <= max_model_len` (one sampled token plus the method's one speculative
    token). `capture()` may be called repeatedly but not concurrently from several threads.
    """

    def __init__(self, model_path: str, aux_layer_ids: Sequence[int], engine_kwargs: dict):
        from transformers import AutoConfig
        from vllm import LLM

        kw = dict(engine_kwargs)
        for key in ("model", "speculative_config", "kv_transfer_config"):
            if key in kw:
                raise ValueError(f"engine_kwargs may not set {key!r}: VllmCapture sets it")
        if kw.get("enable_prefix_caching"):
            raise ValueError("VllmCapture needs enable_prefix_caching=False")

        hf_cfg = AutoConfig.from_pretrained(
            model_path, trust_remote_code=kw.get("trust_remote_code", False))
        num_layers = hf_cfg.get_text_config().num_hidden_layers
        ids = sorted(int(i) for i in aux_layer_ids)
        if not ids or len(set(ids)) != len(ids) or ids[0] < 0 or ids[-1] >= num_layers:
            raise ValueError(f"aux_layer_ids must be distinct ids in [0, {num_layers}), "
                             f"got {list(aux_layer_ids)}")
        self.aux_layer_ids = tuple(ids)
        self.num_layers = num_layers
        # vLLM captures in ascending id order (it sorts the set); L = the last layer's output.
        self._captured_ids = ids + [num_layers]

        self._dir = tempfile.mkdtemp(prefix="eagle_ray_vcap_")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True)
        kw.update(
            model=model_path,
            enable_prefix_caching=False,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,  # the only value the method accepts
                "draft_model_config": {"hf_config": {
                    "eagle_aux_hidden_state_layer_ids": self._captured_ids}},
            },
            kv_transfer_config={
                "kv_connector": CONNECTOR_NAME,
                "kv_connector_module_path": __name__,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self._dir,
                                              "use_synchronization_lock": False},
            },
        )
        self.llm = LLM(**kw)
        self._final_norm = self.llm.apply_model(_final_norm_on_cpu)[0]
        from vllm.v1.engine.core_client import InprocClient
        # In-process engine: nothing runs between our calls, so we step it ourselves until
        # the files exist. A multiprocess engine core keeps stepping on its own.
        self._inproc = isinstance(self.llm.llm_engine.engine_core, InprocClient)

    def capture(self, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (aux [T, len(aux)*H], final [T, H]) float32 CPU pair per sequence, in order."""
        from vllm import SamplingParams

        if not sequences:
            return []
        for s in sequences:
            if len(s) == 0:
                raise ValueError("empty sequence")
        # One greedy token: the prefill is the forward pass that fills the hidden-states
        # cache; the connector saves the prompt tokens' slots once the request finishes.
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": list(map(int, s))} for s in sequences],
                                 params, use_tqdm=False)
        paths = [o.kv_transfer_params["hidden_states_path"] for o in outs]
        results = []
        try:
            for seq, path in zip(sequences, paths):
                data = self._load(path)
                hs = data["hidden_states"].to(torch.float32)  # [T, n_aux + 1, H]
                if data["token_ids"].tolist() != list(seq) or hs.shape[0] != len(seq):
                    raise RuntimeError(f"captured states for {path} do not match the request")
                aux = hs[:, :-1].reshape(hs.shape[0], -1)
                with torch.no_grad():
                    final = self._final_norm(hs[:, -1].contiguous())
                results.append((aux.contiguous(), final))
        finally:
            for path in paths:  # also after an error (close() removes any written later)
                if os.path.exists(path):
                    os.remove(path)
        return results

    def _wait(self, path: str) -> None:
        deadline = time.monotonic() + _WAIT_TIMEOUT_S
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM did not write {path}")
            if self._inproc:
                self.llm.llm_engine.step()  # runs the connector's get_finished on the worker
                if not os.path.exists(path):
                    time.sleep(0.001)
            else:
                time.sleep(0.005)

    def _load(self, path: str) -> dict[str, torch.Tensor]:
        self._wait(path)
        return load_file(path, device="cpu")

    def close(self) -> None:
        """Shut the engine down and remove the temporary directory."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            shutdown = getattr(llm.llm_engine.engine_core, "shutdown", None)
            if shutdown is not None:
                shutdown()
        self._cleanup()

    def __enter__(self) -> "VllmCapture":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
