"""Fixed costs of a store and of a generation run as they grow: 10K, 100K, 1M samples.

    .venv/bin/python bench/bench_scale.py [--sizes 10000,100000,1000000] [--dir /tmp/eagle_ray_scale]
                                          [--per-write 4] [--shard-bytes N] [--compact]

Store: built with the project's StoreWriter (tiny hidden size and 4 tokens per sample, so
1M samples are ~0.2 GB; `--per-write` samples per write as `extract.batch_size`, one index
part per write, as extraction commits them; `--shard-bytes` as storage.shard_bytes, default
the recipes' 2 GiB; 1 gives the one-shard-per-write layout), optionally index-compacted
(`store compact`; without it the index is as extraction leaves it: the writer merges
its parts every 64 commits), then timed in a fresh process (peak RSS is that process's): read_index,
HiddenStateStore open, check_store_whole, verify without checksums, and the training plan
(sample lengths + micro-batches).

Generation: a prompts.parquet of N prompts as ingest writes it and a generation output with
half of them done, in parts of 16 rows (generate.batch_size) merged every 64 parts, as a
killed run leaves them;
then, in a fresh process as the resumed driver runs it: the first resume's part compaction,
the resume bookkeeping (done prompts, prompts to go, the read tasks of the rest), the
consolidation into conversations.parquet, and that driver's peak RSS.
Prints one table; the growth columns are the point.
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


def build(root: Path, n: int, per_write: int, shard_bytes: int) -> None:
    import numpy as np
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit" / "store"))
    from eagle_ray.store.format import StoreManifest
    from eagle_ray.store.writer import SampleFeatures, StoreWriter

    m = StoreManifest(target_path="t", target_revision=None, target_fingerprint="fp",
                      architecture="Llama", hidden_size=H, num_layers=8, vocab_size=100,
                      aux_layer_ids=(2, 4, 5), dtype="bf16", max_seq_len=64, tokenizer_fingerprint="tok")
    # the layout as extraction leaves it: the writer compacts its index every 64 commits
    w = StoreWriter(root, m, shard_bytes=shard_bytes)
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


GEN_BATCH = 16


def build_generation(root: Path, n: int) -> None:
    """prompts.parquet (N prompts, ingest's writer settings) and gen/parts with N/2 done."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle_ray.generate.run import PARTS_DIR, compact_parts
    from eagle_ray.generate.stage import CONVERSATIONS_SCHEMA
    from eagle_ray.store.compact import COMPACT_EVERY_PARTS

    root.mkdir(parents=True, exist_ok=True)
    ids = [f"s{i:020x}" for i in range(n)]  # ingest's ids: "s" + 20 hex digits of a sha256
    msgs = [f'[{{"role": "user", "content": "question {i}"}}]' for i in range(n)]
    pq.write_table(pa.table({"sample_id": ids, "source": ["bench"] * n, "messages": msgs,
                             "reference": pa.nulls(n, pa.string())}),
                   root / "prompts.parquet", compression="zstd", row_group_size=100_000)
    parts = root / "gen" / PARTS_DIR
    parts.mkdir(parents=True, exist_ok=True)
    tokens = list(range(64))
    for lo in range(0, n // 2, GEN_BATCH):
        k = min(GEN_BATCH, n // 2 - lo)
        cols = {"sample_id": ids[lo:lo + k], "source": ["bench"] * k, "status": ["ok"] * k,
                "origin": ["regenerated"] * k, "messages": msgs[lo:lo + k],
                "completion_text": ["a completion"] * k, "content": ["a completion"] * k,
                "prompt_token_ids": [tokens[:16]] * k, "completion_token_ids": [tokens] * k,
                "num_prompt_tokens": [16] * k, "num_completion_tokens": [64] * k,
                "num_tokens": [80] * k, "num_loss_tokens": [64] * k, "truncated": [False] * k,
                "finish_reason": ["stop"] * k}
        t = pa.table({f.name: cols.get(f.name, pa.nulls(k, f.type)) for f in CONVERSATIONS_SCHEMA},
                     schema=CONVERSATIONS_SCHEMA)
        pq.write_table(t, parts / f"part-{lo:012d}.parquet", compression="zstd")
        if (lo // GEN_BATCH + 1) % COMPACT_EVERY_PARTS == 0:
            compact_parts(parts, blocking=False)  # as the generation driver does every 64 parts
    (root / "built").write_text("")


def measure_generation(root: str) -> None:
    """One process, as a resumed generation driver: time each step once, print JSON."""
    import vllm  # noqa: F401  (the driver imports it: its RSS is part of the baseline)

    from eagle_ray.generate.prompts import ParquetRows, count_not_in
    from eagle_ray.generate.run import PARTS_DIR, compact_parts, consolidate, done_prompts

    root = Path(root)
    parts = root / "gen" / PARTS_DIR
    out = {"files_before": len(list(parts.glob("*.parquet")))}
    t = time.perf_counter()
    compact_parts(parts)  # the first resume merges what the killed run left
    out["compact_s"] = time.perf_counter() - t
    out["files_after"] = len(list(parts.glob("*.parquet")))
    t = time.perf_counter()
    done = done_prompts(parts)
    todo = count_not_in(root / "prompts.parquet", done)
    src = ParquetRows([root / "prompts.parquet"], ["sample_id", "source", "messages", "reference"],
                      block_rows=GEN_BATCH, exclude=done)
    out["resume_s"] = time.perf_counter() - t
    out["todo"] = todo
    assert src.total_rows == todo + len(done)
    del done, src
    t = time.perf_counter()
    counts = consolidate(root / "gen", root / "prompts.parquet", {"sampling": {"samples_per_prompt": 1}})
    out["consolidate_s"] = time.perf_counter() - t
    out["ok"] = counts["ok"]
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10000,100000,1000000")
    p.add_argument("--dir", default="/tmp/eagle_ray_scale")
    p.add_argument("--per-write", type=int, default=4)
    p.add_argument("--shard-bytes", type=int, default=2 * 1024 ** 3)
    p.add_argument("--compact", action="store_true", help="compact each store's index first")
    p.add_argument("--no-generation", action="store_true", help="the store columns only")
    p.add_argument("--build-only", action="store_true", help="build what is missing, measure nothing")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--measure-generation", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.measure:
        return measure(a.measure)
    if a.measure_generation:
        return measure_generation(a.measure_generation)
    rows = []
    for n in (int(x) for x in a.sizes.split(",")):
        root = Path(a.dir) / f"store-{n}-{a.per_write}-{a.shard_bytes}"
        if not (root / "built").exists():
            import shutil

            shutil.rmtree(root, ignore_errors=True)  # a build that was cut short
            t = time.perf_counter()
            build(root, n, a.per_write, a.shard_bytes)
            (root / "built").write_text("")
            print(f"built {n:,} samples in {time.perf_counter() - t:.0f}s", file=sys.stderr)
        if a.build_only:
            groot = Path(a.dir) / f"generation-{n}"
            if not a.no_generation and not (groot / "built").exists():
                build_generation(groot, n)
            continue
        if a.compact:
            from eagle_ray.store.compact import compact

            t = time.perf_counter()
            compact(root, everything=True)
            print(f"compacted {n:,} in {time.perf_counter() - t:.1f}s", file=sys.stderr)
        files = len(list((root / "index").glob("*.parquet"))) + len(list((root / "shards").glob("*")))
        r = json.loads(subprocess.run([sys.executable, __file__, "--measure", str(root)], check=True,
                                      capture_output=True, text=True).stdout.strip().splitlines()[-1])
        g = None
        if not a.no_generation:
            groot = Path(a.dir) / f"generation-{n}"
            if not (groot / "built").exists():
                t = time.perf_counter()
                build_generation(groot, n)
                print(f"built {n:,} prompts in {time.perf_counter() - t:.0f}s", file=sys.stderr)
            g = json.loads(subprocess.run(
                [sys.executable, __file__, "--measure-generation", str(groot)], check=True,
                capture_output=True, text=True).stdout.strip().splitlines()[-1])
        rows.append((n, files, r, g))
    if a.build_only:
        return
    print(f"\nstore: shard_bytes {a.shard_bytes:,}, {a.per_write} samples per write"
          f"{', index compacted by store compact' if a.compact else ', writers compact every 64 commits'}\n")
    print("| samples | files | read_index s | open s | check_store_whole s | verify (no checksums) s "
          "| training plan s | peak RSS MB |\n|---|---|---|---|---|---|---|---|")
    for n, files, r, _ in rows:
        print(f"| {n:,} | {files:,} | {r['read_index_s']:.2f} | {r['open_s']:.2f} | {r['check_s']:.2f} | "
              f"{r['verify_s']:.2f} | {r['plan_s']:.2f} | {r['peak_rss_mb']:.0f} |")
    if a.no_generation:
        return
    print("\ngeneration: N prompts, N/2 done in parts of 16 rows merged every 64 (a killed run), resumed\n")
    print("| prompts | part files before -> after the first resume | first-resume compaction s "
          "| resume bookkeeping s | consolidate s | driver peak RSS MB |\n|---|---|---|---|---|---|")
    for n, _, _, g in rows:
        print(f"| {n:,} | {g['files_before']:,} -> {g['files_after']:,} | {g['compact_s']:.2f} | "
              f"{g['resume_s']:.2f} | {g['consolidate_s']:.2f} | {g['peak_rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
