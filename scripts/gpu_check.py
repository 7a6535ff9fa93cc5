"""GPU readiness: the tiny targets through the whole pipeline on CUDA, with a table.

Run through `scripts/gpu_check.sh` (which installs the GPU stack first). Not part of CI.

For each tiny target (the Llama `tiny_cpu` and, when its recipe exists, the Kimi-K2.5 twin
`tiny_kimi_cpu`) it runs ingest -> generate -> extract -> train -> export -> check -> evaluate
with the SAME recipe the CPU runs, changed only by `--set` overrides that a GPU needs:

    generate/extract.gpus_per_replica = TP   (vLLM CUDA build, one GPU per TP rank)
    target.tensor_parallel_size = 2          (the twin, when >= 2 GPUs: a TP=2 placement group)
    train.use_gpu = true, train.num_workers = every GPU   (nccl DDP over all of them)
    engine.dtype = bfloat16, kv cache by gpu_memory_utilization  (the drafter exports in bf16)
    CPU-only engine arguments cleared (attention_backend, custom_ops, env)

and prints one row per target and stage: passed?, seconds, and the stage's throughput.
`--quick` runs fewer samples and steps (the default fits in ~10 minutes on one H200).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl_allreduce_check(n: int) -> tuple[bool, str]:
    """A bare nccl all-reduce over every GPU (before any Ray), so a broken NCCL shows as such."""
    code = (
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('nccl'); r = dist.get_rank(); torch.cuda.set_device(r)\n"
        "x = torch.full((1 << 20,), float(r + 1), device='cuda'); dist.all_reduce(x)\n"
        "want = sum(range(1, dist.get_world_size() + 1))\n"
        "assert float(x[0]) == want, (float(x[0]), want); dist.destroy_process_group()\n")
    script = Path(f"/tmp/eagle_ray_nccl_check_{n}.py")
    script.write_text(code)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
                        str(script)], capture_output=True, text=True, timeout=300)
    return p.returncode == 0, (p.stderr.strip().splitlines() or [""])[-1][:120]


def gpu_overrides(recipe_name: str, n_gpus: int, quick: bool) -> list[str]:
    from eagle_ray.config import EngineConfig
    from eagle_ray.recipes import load_recipe

    base = load_recipe(recipe_name)
    tp = 2 if (recipe_name != "tiny_cpu" and n_gpus >= 2) else 1
    sets = [f"target.tensor_parallel_size={tp}", f"generate.gpus_per_replica={tp}",
            f"extract.gpus_per_replica={tp}", "train.use_gpu=true", f"train.num_workers={n_gpus}",
            "train.cpus_per_worker=1", "engine.dtype=bfloat16", "engine.kv_cache_memory_bytes=none",
            "engine.gpu_memory_utilization=0.3", "engine.num_cpus_per_replica=1",
            "extract.num_cpus_per_replica=1"]
    # CPU-only engine arguments of a recipe go back to the GPU defaults.
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for name in ("attention_backend", "custom_ops", "env"):
        if name in fields and getattr(base.engine, name) != getattr(EngineConfig(), name):
            default = getattr(EngineConfig(), name)
            sets.append(f"engine.{name}=" + ("none" if default is None else ",".join(default)))
    if quick:
        sets += ["train.max_steps=100", "train.eval_interval=100", "train.ckpt_interval=100"]
    return sets


def run_target(recipe_name: str, n_gpus: int, out: Path, quick: bool) -> list[dict]:
    from eagle_ray.recipes import load_recipe
    from eagle_ray.job.pipeline import SAMPLE_DATA, run_end_to_end

    recipe = load_recipe(recipe_name, gpu_overrides(recipe_name, n_gpus, quick))
    rows: list[dict] = []
    t0 = time.time()
    try:
        s = run_end_to_end(recipe, SAMPLE_DATA, out / recipe_name)
    except BaseException as e:  # report and go on to the next target
        traceback.print_exc()
        return [{"target": recipe_name, "stage": "pipeline", "ok": False,
                 "seconds": time.time() - t0, "rate": f"FAILED: {type(e).__name__}: {e}"[:160]}]
    tm = s["timings_s"]
    gen_tok = s["generate_stats"]["overall"]["loss_tokens"]  # completion tokens (loss-masked)
    rows.append({"target": recipe_name, "stage": "generate", "ok": True, "seconds": tm["generate"],
                 "rate": f"{s['generate']['generated']} conversations, "
                         f"{gen_tok / max(1e-9, tm['generate']):,.0f} tok/s (incl. start-up)"})
    rows.append({"target": recipe_name, "stage": "extract", "ok": s["store_verify"]["ok"],
                 "seconds": tm["extract"],
                 "rate": f"{s['extract']['tokens'] / max(1e-9, tm['extract']):,.0f} tok/s (incl. start-up)"})
    tr = s["train"]
    rows.append({"target": recipe_name, "stage": f"train (nccl DDP x{n_gpus})", "ok": True,
                 "seconds": tm["train"],
                 "rate": f"{tr.get('train/tokens_per_s', 0):,.0f} tok/s, val acc0 "
                         f"{tr.get('val/acc_step0', float('nan')):.3f}"})
    ev = s["evaluate"]
    rows.append({"target": recipe_name, "stage": "export+check+evaluate",
                 "ok": bool(ev["outputs_identical"]),
                 "seconds": tm["export_check_evaluate"],
                 "rate": f"acceptance length trained {ev['online']['mean_acceptance_length']:.2f} vs "
                         f"n-gram {ev['ngram']['mean_acceptance_length']:.2f}; check max|diff| "
                         f"{s['check'].get('max_abs_diff', float('nan')):.3g}"})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/gpu_check")
    ap.add_argument("--quick", action="store_true", default=True)
    ap.add_argument("--targets", nargs="+", default=["tiny_cpu", "tiny_kimi_cpu"])
    a = ap.parse_args()
    from eagle_ray.recipes import RECIPES

    n = gpu_count()
    if n == 0:
        print("gpu_check: no CUDA GPU visible to torch; nothing to check", file=sys.stderr)
        return 2
    import torch
    import vllm

    print(f"gpu_check: {n} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"vllm {vllm.__version__}")
    rows = []
    t0 = time.time()
    ok, msg = nccl_allreduce_check(n)
    rows.append({"target": "-", "stage": f"nccl all-reduce x{n}", "ok": ok,
                 "seconds": time.time() - t0, "rate": msg if not ok else ""})
    out = Path(a.out)
    for name in a.targets:
        if name not in RECIPES:
            rows.append({"target": name, "stage": "-", "ok": False, "seconds": 0.0,
                         "rate": "no such recipe in this checkout"})
            continue
        rows += run_target(name, n, out, a.quick)
    print("\n| target | stage | passed | s | throughput / result |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['target']} | {r['stage']} | {'yes' if r['ok'] else 'NO'} | "
              f"{r['seconds']:.1f} | {r['rate']} |")
    (out / "gpu_check.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(rows, indent=2))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
