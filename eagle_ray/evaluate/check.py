"""`eagle-ray check`: will serving feed the drafter the features it was trained on?

Static: the exported config against the store manifest (layer ids present and equal, hidden
size, vocabulary, target and tokenizer fingerprints, capture conventions).
Runtime: load target + drafter in vLLM (in-process engine), prefill a store sample, capture
the features vLLM hands the drafter (`combine_hidden_states` input, [tokens, 3H]) and compare
them with the store's features for the same tokens. A drafter fed H-wide single-layer
features, other layers, or features shifted by a layer fails here, loudly, with the cause.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class CheckResult:
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def fail(self, msg: str) -> None:
        self.ok = False
        self.problems.append(msg)


def config_layer_ids(cfg: dict) -> list[int] | None:
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = ids if ids is not None else cfg.get("eagle_aux_hidden_state_layer_ids")
    return [int(i) for i in ids] if ids is not None else None


def static_check(cfg: dict, manifest) -> CheckResult:
    r = CheckResult()
    ids = config_layer_ids(cfg)
    if ids is None:
        L = manifest.num_layers
        r.fail("drafter config has no eagle_aux_hidden_state_layer_ids: vLLM would pick its own "
               f"default layers (e.g. (2, {L // 2}, {L - 3}) for {L} layers) instead of the ones the "
               f"drafter was trained on {list(manifest.aux_layer_ids)}; re-export the drafter")
    elif ids != list(manifest.aux_layer_ids):
        r.fail(f"aux layer ids mismatch: drafter config says {ids}, the store was captured at "
               f"{list(manifest.aux_layer_ids)}")
    if int(cfg.get("target_hidden_size", cfg.get("hidden_size", -1))) != manifest.hidden_size:
        r.fail(f"hidden size mismatch: drafter expects {cfg.get('target_hidden_size')}, store has "
               f"{manifest.hidden_size}")
    if int(cfg.get("vocab_size", -1)) != manifest.vocab_size:
        r.fail(f"vocabulary mismatch: drafter vocab_size {cfg.get('vocab_size')}, target/store "
               f"{manifest.vocab_size}")
    trained_on = (cfg.get("eagle_ray") or {}).get("store")
    if trained_on is None:
        r.fail("drafter config does not record the store it was trained on (not exported by "
               "eagle-ray); cannot prove it matches this target")
    else:
        for key, what in (("target_fingerprint", "target"), ("tokenizer_fingerprint", "tokenizer"),
                          ("capture_convention", "capture convention"),
                          ("final_convention", "final-feature convention")):
            if trained_on.get(key) != getattr(manifest, key):
                r.fail(f"the drafter was trained on another {what}'s features: its {key} is "
                       f"{str(trained_on.get(key))[:16]}..., this store's is {str(getattr(manifest, key))[:16]}...")
    return r


def runtime_check(drafter_dir: str | Path, target_dir: str | Path, store, engine_kw: dict,
                  sample: int | str = 0, atol: float | None = None) -> CheckResult:
    """Prefill one store sample in vLLM with the drafter attached; compare the features vLLM
    feeds the drafter with the store's."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    r = CheckResult()
    s = store.get(sample)
    ids = s["input_ids"].tolist()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the drafter must live in this process
    kw = {k: v for k, v in engine_kw.items() if k not in ("model", "tokenizer")}
    kw["enable_prefix_caching"] = False  # every prompt token must reach the drafter
    llm = LLM(model=str(target_dir), tokenizer=str(target_dir), **kw,
              speculative_config={"method": "eagle3", "model": str(drafter_dir),
                                  "num_speculative_tokens": 1})
    captured: list[torch.Tensor] = []
    try:
        core = llm.llm_engine.engine_core.engine_core
        worker = core.model_executor.driver_worker
        drafter = getattr(worker, "worker", worker).model_runner.drafter.model
        inner = drafter.combine_hidden_states

        def spy(hidden_states):
            captured.append(hidden_states.detach().float().cpu().clone())
            return inner(hidden_states)

        drafter.combine_hidden_states = spy
        llm.generate([TokensPrompt(prompt_token_ids=ids)],
                     SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    finally:
        del llm
        gc.collect()
    if not captured:
        r.fail("vLLM never called the drafter's combine_hidden_states: is the method eagle3?")
        return r
    got = captured[0]
    want = s["aux"].float()
    r.details["fed_shape"] = list(got.shape)
    r.details["store_shape"] = list(want.shape)
    if got.shape[-1] != want.shape[-1]:
        r.fail(f"vLLM feeds the drafter {got.shape[-1]}-wide features but it was trained on "
               f"{want.shape[-1]}-wide ({want.shape[-1] // store.manifest.hidden_size} layers "
               "concatenated): single-layer features at serving time")
        return r
    n = min(len(got), len(want))
    diff = (got[:n] - want[:n]).abs()
    scale = want[:n].abs().max().item()
    tol = atol if atol is not None else (1e-3 if store.manifest.dtype == "fp32" else 0.02) * max(1.0, scale)
    H = store.manifest.hidden_size
    per_layer = [diff[:, b * H:(b + 1) * H].max().item() for b in range(want.shape[1] // H)]
    r.details.update(tokens_compared=n, max_abs_diff=diff.max().item(), tolerance=tol,
                     max_abs_diff_per_layer=dict(zip(store.manifest.aux_layer_ids, per_layer)))
    if diff.max().item() > tol:
        bad = [lid for lid, d in zip(store.manifest.aux_layer_ids, per_layer) if d > tol]
        r.fail(f"vLLM feeds the drafter other features than it was trained on: layers {bad} differ "
               f"(max |diff| {diff.max().item():.3g} > tolerance {tol:.3g}); the serving engine "
               "captures other layers than the store (e.g. ids shifted by one, or a store written "
               "with an off-by-one capture)")
    return r


def run_check(recipe, drafter_dir: str | Path, store_dir: str | Path,
              target_dir: str | Path | None = None, *, runtime: bool = True) -> CheckResult:
    from eagle_ray.config import resolve_target_path
    from eagle_ray.engine import engine_kwargs
    from eagle_ray.export.drafter import read_drafter_config
    from eagle_ray.store.reader import HiddenStateStore

    cfg = read_drafter_config(drafter_dir)
    store = HiddenStateStore(store_dir)
    result = static_check(cfg, store.manifest)
    if result.ok and runtime:
        tdir = Path(target_dir) if target_dir else resolve_target_path(recipe.target)
        rt = runtime_check(drafter_dir, tdir, store, engine_kwargs(recipe, str(tdir)))
        result.details.update(rt.details)
        for p in rt.problems:
            result.fail(p)
    return result
