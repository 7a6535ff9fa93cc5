"""Fixed costs of a store as it grows: 10K, 100K, 1M samples.

    .venv/bin/python bench/bench_scale.py [--sizes 10000,100000,1000000] [--dir /tmp/eagle_ray_scale]
                                          [--per-write 4] [--compact]

Builds each store with the project's StoreWriter (tiny hidden size and 4 tokens per sample,
so 1M samples are ~0.2 GB; `--per-write` samples per write as `extract.batch_size`, one
index part per write, as extraction commits them), optionally compacts its index (`store
compact`), then times, each in a fresh process (peak RSS is that process's): read_index,
HiddenStateStore open, check_store_whole, verify without checksums, and the training plan
(sample lengths + micro-batches). Prints one table; the growth columns are the point.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

H, A, T = 4, 3, 4


def build(root: Path, n: int, per_write: int) -> None:
    import numpy as np
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit" / "store"))
    from eagle_ray.store.format import StoreManifest
    from eagle_ray.store.writer import SampleFeatures, StoreWriter

    m = StoreManifest(target_path="t", target_revision=None, target_fingerprint="fp",
                      architecture="Llama", hidden_size=H, num_layers=8, vocab_size=100,
                      aux_layer_ids=(2, 4, 5), dtype="bf16", max_seq_len=64, tokenizer_fingerprint="tok")
    w = StoreWriter(root, m, compact_every=0)  # the layout as extraction leaves it before compaction
    aux, fin = torch.zeros(T, A * H), torch.zeros(T, H)
    ids, mask = np.arange(T, dtype=np.int32), np.ones(T, bool)
    for lo in range(0, n, per_write):
        w.write_shard([SampleFeatures(sample_id=f"s{i:08d}", source="bench", input_ids=ids,
                                      loss_mask=mask, aux=aux, final=fin, num_tokens_untruncated=T)
                       for i in range(lo, min(n, lo + per_write))])


def measure(root: str) -> None:
    """One process: time each fixed cost once, print JSON."""
    from eagle_ray.store.reader import HiddenStateStore, check_store_whole, read_index, verify_store
    from eagle_ray.train.data import make_batches, sample_lengths

    out = {}
    t = time.perf_counter()
    read_index(root)
    out["read_index_s"] = time.perf_counter() - t
    t = time.perf_counter()
    store = HiddenStateStore(root)
    out["open_s"] = time.perf_counter() - t
    t = time.perf_counter()
    check_store_whole(root)
    out["check_s"] = time.perf_counter() - t
    t = time.perf_counter()
    verify_store(root, checksums=False)
    out["verify_s"] = time.perf_counter() - t
    t = time.perf_counter()
    lengths = sample_lengths(store, store.sample_ids)
    make_batches(lengths, 2048, 0)
    out["plan_s"] = time.perf_counter() - t
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10000,100000,1000000")
    p.add_argument("--dir", default="/tmp/eagle_ray_scale")
    p.add_argument("--per-write", type=int, default=4)
    p.add_argument("--compact", action="store_true", help="compact each store's index first")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.measure:
        return measure(a.measure)
    rows = []
    for n in (int(x) for x in a.sizes.split(",")):
        root = Path(a.dir) / f"store-{n}-{a.per_write}"
        if not (root / "index").exists() or len(list((root / "index").iterdir())) == 0:
            t = time.perf_counter()
            build(root, n, a.per_write)
            print(f"built {n:,} samples in {time.perf_counter() - t:.0f}s", file=sys.stderr)
        if a.compact:
            from eagle_ray.store.compact import compact

            t = time.perf_counter()
            compact(root, everything=True)
            print(f"compacted {n:,} in {time.perf_counter() - t:.1f}s", file=sys.stderr)
        files = len(list((root / "index").glob("*.parquet"))) + len(list((root / "shards").glob("*")))
        r = json.loads(subprocess.run([sys.executable, __file__, "--measure", str(root)], check=True,
                                      capture_output=True, text=True).stdout.strip().splitlines()[-1])
        rows.append((n, files, r))
    print(f"\n| samples | files | read_index s | open s | check_store_whole s | verify (no checksums) s "
          f"| training plan s | peak RSS MB |\n|---|---|---|---|---|---|---|---|")
    for n, files, r in rows:
        print(f"| {n:,} | {files:,} | {r['read_index_s']:.2f} | {r['open_s']:.2f} | {r['check_s']:.2f} | "
              f"{r['verify_s']:.2f} | {r['plan_s']:.2f} | {r['peak_rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
