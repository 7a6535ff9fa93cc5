"""Drafter training throughput and data-wait fraction (Ray Train, CPU/gloo here).

    .venv/bin/python bench/bench_train.py [--samples 600] [--steps 60]

Builds a store from the tiny target (logged corpus conversations, HF extraction), then trains
the drafter for --steps optimizer steps with 1 and 2 workers and prints tokens/s and the
fraction of step time the training loop waited for data (target < 5%).
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()

    import ray

    from eagle_ray.recipes import load_recipe
    from eagle_ray.data.ingest import SourceSpec, ingest
    from eagle_ray.extract.run import run_extract
    from eagle_ray.generate.run import run_generate
    from eagle_ray.targets.tiny import corpus
    from eagle_ray.train.run import run_train

    d = Path(tempfile.mkdtemp(prefix="bench_train_"))
    lines = [json.dumps({"messages": c}) for c in corpus.conversations(args.samples, seed=44, max_turns=3)]
    (d / "in.jsonl").write_text("\n".join(lines) + "\n")
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=512 << 20)
    ingest([SourceSpec.parse(str(d / "in.jsonl"))], d / "prompts")
    r = load_recipe("tiny_cpu", ["generate.mode=keep_logged", "extract.backend=hf"])
    run_generate(r, d / "prompts", d / "conv")
    run_extract(r, d / "conv", d / "store")

    rows = []
    for workers in (1, 2):
        run = d / f"run{workers}"
        recipe = load_recipe("tiny_cpu", [f"train.num_workers={workers}", "train.cpus_per_worker=1",
                                          f"train.max_steps={args.steps}", "train.log_interval=10",
                                          f"train.eval_interval={args.steps}",
                                          f"train.ckpt_interval={args.steps}"])
        last = run_train(recipe, d / "store", run)
        rows.append((workers, last["train/tokens_per_s"], last["train/data_wait_frac"],
                     last["val/acc_step0"]))
    ray.shutdown()
    print(f"\n{args.samples} samples, {args.steps} steps, tokens_per_batch 2048 per worker, "
          f"tiny target (H=128), CPU gloo\n")
    print(f"| {'workers':>7} | {'tokens/s':>9} | {'data wait':>9} | {'val acc step0':>13} |")
    print(f"|{'-' * 9}|{'-' * 11}|{'-' * 11}|{'-' * 15}|")
    for w, tps, wait, acc in rows:
        print(f"| {w:>7} | {tps:>9,.0f} | {wait:>8.1%} | {acc:>13.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
