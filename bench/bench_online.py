"""Online vs offline drafter training on the tiny target: training tokens/s, data-wait
fraction, and the object store's peak bytes while training (polled every 0.2 s).

    .venv/bin/python bench/bench_online.py [--samples 400] [--steps 60]

Both runs train the same samples for the same steps (2 workers x 0.5 CPU; online adds 2
extractor actors x 0.5 CPU running the target's prefill on the same 2 cores). The offline
figures exclude building the store (measured by bench/bench_store.py); the online run has no
store. Each run is the second half of one process with its own local Ray.
"""

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()

    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    from eagle_ray.recipes import load_recipe
    from eagle_ray.train.run import run_train
    from tests.integration.conftest import logged_store

    sets = ["generate.mode=keep_logged", "storage.dtype=bf16", "data.max_seq_len=256",
            "train.num_workers=2", f"train.max_steps={args.steps}",
            f"train.eval_interval={args.steps}", f"train.ckpt_interval={args.steps}",
            f"train.log_interval={args.steps // 3}", "train.cpus_per_worker=0.5",
            "extract.num_cpus_per_replica=0.5", "extract.max_replicas=2"]
    r = load_recipe("tiny_cpu", sets)
    d = Path(tempfile.mkdtemp(prefix="bench_online_"))
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=512 << 20)
    store = logged_store(d, args.samples, 7, r)
    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    rows = []
    for mode in ("offline", "online"):
        peak, stop = [0], threading.Event()

        def poll():
            while not stop.is_set():
                peak[0] = max(peak[0], get_memory_info_reply(state).store_stats.object_store_bytes_used)
                time.sleep(0.2)

        th = threading.Thread(target=poll, daemon=True)
        th.start()
        t0 = time.time()
        m = (run_train(r, store, d / "off") if mode == "offline"
             else run_train(r, None, d / "on", conversations=d / "conv"))
        wall = time.time() - t0
        stop.set()
        th.join()
        rows.append((mode, m, wall, peak[0]))
    print(f"\n{args.samples} samples, {args.steps} steps, 2 workers, storage bf16, tiny target, 2 cores\n")
    print("| training | tokens/s | data-wait fraction | held-out acc step 0 | wall s (incl. start-up) "
          "| object store peak MiB | spilled bytes |")
    print("|---|---|---|---|---|---|---|")
    for mode, m, wall, peak in rows:
        print(f"| {mode} | {m['train/tokens_per_s']:,.0f} | {m['train/data_wait_frac']:.3f} | "
              f"{m['val/acc_step0']:.3f} | {wall:.1f} | {peak / 2**20:.2f} | "
              f"{m.get('online/spilled_bytes', '-')} |")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
