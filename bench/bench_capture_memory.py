"""The extractor's host memory over a run: does it grow, and what stops it?

    .venv/bin/python bench/bench_capture_memory.py [--recipe smollm2_cpu] [--batches 60]
        [--batch-size 8] [--max-len 512] [--every 10]
    MALLOC_ARENA_MAX=2 .venv/bin/python bench/bench_capture_memory.py ...   # an allocator setting, A/B

Builds the recipe's extract backend in this process (vLLM's in-process engine, as an
extractor replica runs it), captures `--batches` batches of sequences of random lengths (up to
`--max-len` tokens, random token ids, a fixed seed: every run sees the same batches), and
prints a table of this process's memory (RSS, anonymous) every `--every` batches, with the
growth per captured sample since the first row. `--trim`: what ExtractUDF does after
every batch (glibc malloc_trim). Seen in the 2,000-prompt SmolLM2 run: the
extractor's RSS went 3.7 -> 4.5 GiB over 400 samples, ~2 MB a sample, about one sample's
features (T x 3 x 576 + T x 576 floats): a leak would match that, an allocator's
fragmentation would level off.
"""

from __future__ import annotations

import argparse
import os
import random
import time


def _mem() -> dict[str, int]:
    """RSS and anonymous memory of this process, bytes (Linux smaps_rollup)."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Anonymous"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="smollm2_cpu")
    p.add_argument("--batches", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--trim", action="store_true", help="glibc malloc_trim(0) after every batch")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = p.parse_args(argv)

    import gc

    from eagle_ray.extract.stage import make_backend, release_freed_memory
    from eagle_ray.recipes import load_recipe
    from eagle_ray.targets.resolve import resolve_target_path

    from eagle_ray.vllm.engine import ENGINE_ENV

    os.environ.update(ENGINE_ENV)  # as the extractor actor runs it: the engine core in this process
    recipe = load_recipe(args.recipe, [f"data.max_seq_len={args.max_len}", *args.set])
    backend = make_backend(recipe, str(resolve_target_path(recipe.target)))
    vocab = recipe.target.vocab_size
    rng = random.Random(0)
    allocator = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    print(f"recipe {recipe.name}, backend {recipe.extract.backend}, allocator env {allocator or 'none'}"
          f"{', malloc_trim after every batch' if args.trim else ''}")
    print("| batch | samples | tokens | RSS MiB | anonymous MiB | anon growth per sample since row 1 | s |")
    print("|---|---|---|---|---|---|---|")
    first = None
    samples = tokens = 0
    t0 = time.time()
    for b in range(1, args.batches + 1):
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(16, args.max_len))]
                for _ in range(args.batch_size)]
        feats = backend.capture(seqs)
        samples += len(seqs)
        tokens += sum(len(s) for s in seqs)
        del feats
        gc.collect()
        if args.trim:
            release_freed_memory()  # what ExtractUDF does after every batch
        if b == 1 or b % args.every == 0:
            m = _mem()
            if first is None:
                first = (samples, m["Anonymous"])
            per = ((m["Anonymous"] - first[1]) / (samples - first[0]) / 2**20
                   if samples > first[0] else 0.0)
            print(f"| {b} | {samples} | {tokens} | {m['Rss'] / 2**20:,.0f} | "
                  f"{m['Anonymous'] / 2**20:,.0f} | {per:.2f} MiB | {time.time() - t0:.0f} |",
                  flush=True)
    backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
