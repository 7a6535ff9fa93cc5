"""Export a trained drafter as a directory vLLM loads with the "eagle3" speculative method.

Layout: the original EAGLE-3 / SpecForge checkpoint layout that vLLM 0.32's
`Eagle3LlamaForCausalLM` reads directly (`architectures: ["LlamaForCausalLMEagle3"]`):

    DRAFTER/config.json        Llama config of the one drafter layer + draft_vocab_size,
                               target_hidden_size, eagle_config.eagle_aux_hidden_state_layer_ids
                               (always explicit: never left to the engine's default), norm eps
                               and rope, and an "eagle_ray" block with the store identity the
                               drafter was trained on (target/tokenizer fingerprints, layers,
                               conventions) for `eagle-ray check`
    DRAFTER/model.safetensors  fc, midlayer.*, norm, lm_head in the served dtype (bf16 for
                               GPU recipes), d2t (offsets) and t2d unless the draft vocab is
                               the full vocab (vLLM then refuses them)

We chose it over the speculators config layout because vLLM reads it without a conversion
step on both our pinned builds, and it carries d2t/t2d as tensors next to the weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle_ray.common.outputs import check_output_dir, replace_dir_atomically
from eagle_ray.common.atomic import atomic_write_json
from eagle_ray.common.provenance import provenance

EXPORT_FILES = ("config.json", "model.safetensors", "serving.json")

IDENTITY_KEYS = ("target_fingerprint", "tokenizer_fingerprint", "hidden_size", "num_layers",
                 "vocab_size", "aux_layer_ids", "capture_convention", "final_convention")


def build_drafter(run_info: dict, state: dict | None = None):
    """An Eagle3Drafter for a run (weights from `state` if given, else freshly initialised)."""
    import torch

    from eagle_ray.model.drafter import DrafterArch, Eagle3Drafter

    arch = DrafterArch(**run_info["arch"])
    model = Eagle3Drafter(arch, d2t=torch.tensor(run_info["d2t"]))
    if state is not None:
        state = dict(state)
        for name in ("d2t", "t2d"):  # an export with the full vocab carries neither
            if name not in state and arch.draft_vocab_size == arch.target_vocab_size:
                state[name] = getattr(model, name)
        model.load_state_dict(state, strict=True)
    return model


def served_dtype(engine_dtype: str, target_cfg: dict) -> str:
    """The dtype vLLM will run the drafter in: the recipe's engine dtype, or with "auto" the
    target's checkpoint dtype (bfloat16 for Llama-3.1 and Kimi-K2.5), as vLLM resolves it.
    Exporting in it means the served weights are the trained ones rounded once, by us."""
    if engine_dtype and engine_dtype != "auto":
        return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32",
                "fp32": "float32"}.get(engine_dtype, engine_dtype)
    return str(target_cfg.get("dtype") or target_cfg.get("torch_dtype") or "bfloat16")


def export_drafter(run_dir: str | Path, out_dir: str | Path, *, untrained: bool = False,
                   seed: int = 0, evaluation: str | Path | None = None) -> Path:
    """Write DRAFTER_DIR from the latest checkpoint of run_dir (or an untrained drafter of
    the same shape and vocabulary, the baseline `evaluate` compares against). `evaluation`:
    an `eagle-ray evaluate` report.json of this drafter, whose measured recommendation
    (draft_sample_method at the serving profile) serving.json then carries."""
    import torch
    from safetensors.torch import load_file, save_file

    from eagle_ray.export.vllm_layout import state_dict_for_export, vllm_config
    from eagle_ray.train.checkpoint import newest_loadable as latest_checkpoint

    run = Path(run_dir)
    # Refused before any work: a file, or a directory that is not an earlier export.
    check_output_dir(out_dir, "export", only=EXPORT_FILES)
    if not (run / "run.json").exists():
        raise FileNotFoundError(f"{run / 'run.json'} does not exist: {run} is not a training run "
                                "directory; pass the --out of `eagle-ray train`")
    info = json.loads((run / "run.json").read_text())
    if untrained:
        torch.manual_seed(seed)
        model = build_drafter(info)
    else:
        ckpt = latest_checkpoint(run)
        if ckpt is None:
            raise FileNotFoundError(f"{run} has no checkpoint; run `eagle-ray train` first")
        model = build_drafter(info, load_file(str(ckpt / "model.safetensors")))
    manifest = info["store_manifest"]
    target_cfg = json.loads((Path(info["target_dir"]) / "config.json").read_text())
    target_cfg = target_cfg.get("text_config", target_cfg)
    dtype = served_dtype(info["recipe"]["engine"]["dtype"], target_cfg)
    cfg = vllm_config(model.arch, target_cfg, manifest["aux_layer_ids"], dtype=dtype)
    cfg["eagle_ray"] = {"store": {k: manifest[k] for k in IDENTITY_KEYS},
                        "target_path": manifest.get("target_path"),
                        "trained": not untrained, "run_dir": str(run.resolve()),
                        "provenance": provenance()}
    serving = serving_recommendation(info, Path(out_dir).resolve())
    if evaluation is not None:
        serving = with_measured_recommendation(serving, evaluation, run)

    def write(tmp: Path) -> None:
        save_file(state_dict_for_export(model, getattr(torch, dtype)), str(tmp / "model.safetensors"))
        atomic_write_json(tmp / "config.json", cfg)
        atomic_write_json(tmp / "serving.json", serving)

    # Written next to out_dir and swapped in with one rename: an earlier export is replaced
    # whole or not at all, and a failure leaves no temporary behind.
    return replace_dir_atomically(out_dir, "export", write, only=EXPORT_FILES)


def serving_recommendation(info: dict[str, Any], drafter_dir: Path) -> dict[str, Any]:
    """serving.json: how to serve this drafter the way it was trained to be served: the
    speculative_config for vLLM, the sampling requests should use (the serving profile), the
    sampling its training data was regenerated at, and a `vllm serve` command line."""
    recipe = info["recipe"]
    serve = recipe.get("serve") or {}  # runs from before the serving profile have none
    gen = (info.get("store_manifest") or {}).get("generation") or {}
    profile = (gen.get("serving_profile") or
               {k: serve.get(k) for k in ("temperature", "top_p", "top_k", "min_p")})
    spec = {"method": "eagle3", "model": str(drafter_dir),
            "num_speculative_tokens": int(recipe["drafter"]["num_speculative_tokens"]),
            "draft_sample_method": serve.get("draft_sample_method") or "greedy"}
    target = recipe["target"]
    tp = int(target.get("tensor_parallel_size", 1))
    cmd = (f"vllm serve {target['path']} --tensor-parallel-size {tp} "
           f"--speculative-config '{json.dumps(spec)}'"
           + (" --trust-remote-code" if target.get("trust_remote_code") else "")
           # Agent traffic is served with the target's parsers (tool calls, reasoning).
           + (f" --enable-auto-tool-choice --tool-call-parser {serve['tool_call_parser']}"
              if serve.get("tool_call_parser") else "")
           + (f" --reasoning-parser {serve['reasoning_parser']}" if serve.get("reasoning_parser") else ""))
    return {"speculative_config": spec,
            "request_sampling": {k: profile.get(k) for k in ("temperature", "top_p", "top_k", "min_p")},
            "serving_profile_source": profile.get("source") or serve.get("source"),
            "trained_on_sampling": gen.get("sampling"),
            "command": cmd,
            "note": "Send requests with request_sampling (the serving profile this drafter was "
                    "trained for); `eagle-ray evaluate` measures its acceptance there."}


def with_measured_recommendation(serving: dict[str, Any], report_path: str | Path,
                                 run: Path) -> dict[str, Any]:
    """serving.json with evaluate's measured choice of draft_sample_method (the one that
    accepted most at the serving profile) and the figures behind it. A report of another
    run's drafter is refused."""
    report = json.loads(Path(report_path).read_text())
    cfg_path = Path(report["drafter"]) / "config.json"
    their_run = (json.loads(cfg_path.read_text()).get("eagle_ray", {}).get("run_dir")
                 if cfg_path.exists() else None)
    if their_run is not None and Path(their_run).resolve() != run.resolve():
        raise ValueError(f"{report_path} evaluated the drafter of run {their_run}, not of {run}")
    served = report.get("as_served")
    if not served:
        return serving | {"measured": {"report": str(report_path), "note": "greedy profile: "
                                       "draft_sample_method does not matter"}}
    method = served["recommended_draft_sample_method"]
    spec = serving["speculative_config"] | {"draft_sample_method": method}
    cmd = serving["command"].replace(json.dumps(serving["speculative_config"]), json.dumps(spec))
    return serving | {"speculative_config": spec, "command": cmd, "measured": {
        "report": str(Path(report_path).resolve()), "draft_sample_method": served["draft_sample_method"],
        "recommended": method, "speedup": report["headline"]["speedup"],
        "sampling": served["sampling"], "seeds": served["seeds"], "device": report.get("device")}}


def summary_line(drafter_dir: str | Path) -> str:
    """Export's one line (`eagle-ray export` and the job): where the drafter is and the
    speculative_config its serving.json gives vLLM (as measured, once evaluate has run)."""
    import json

    serving = json.loads((Path(drafter_dir) / "serving.json").read_text())
    return (f"export: drafter written to {drafter_dir} (vLLM: speculative_config="
            f"{json.dumps(serving['speculative_config'])}"
            + (", draft_sample_method as measured by evaluate" if "measured" in serving else "") + ")")


def read_drafter_config(drafter_dir: str | Path) -> dict[str, Any]:
    path = Path(drafter_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{drafter_dir} is not a drafter directory (no config.json)")
    return json.loads(path.read_text())
