"""Ingest + stats throughput on a generated N-line file (default 1M lines).

    .venv/bin/python bench/bench_ingest_stats.py [--lines 1000000] [--dir /tmp/eagle_ray_bench]
                                                 [--token-workers 2]

Generates a mix of OpenAI (with reasoning), ShareGPT and plain-prompt lines from the
shipped corpus (~1% bad lines), then times, in one run on the same file:
  ingest without token counting, ingest with token counting (tiny target's tokenizer) in
  the process, and with --token-workers N on N Ray tokenizer actors (a local Ray started
  first, outside the timed region; its prompts.parquet checked equal byte for byte), and
  stats over the resulting prompts.parquet. Prints a table of lines/s.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

from eagle_ray.recipes import load_recipe
from eagle_ray.data.ingest import SourceSpec, ingest
from eagle_ray.data.stats import compute_stats
from eagle_ray.data.tokenize import length_annotator
from eagle_ray.targets.tiny import corpus


def generate(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            conv = corpus.conversation(rng, max_turns=3)
            conv[-2]["content"] += f" (request {i})"  # mostly unique, like real traffic
            r = rng.random()
            if r < 0.01:
                line = '{"messages": [{"role": "user", "content": "broken'
            elif r < 0.6:
                line = json.dumps({"messages": conv})
            elif r < 0.9:
                m = {"system": "system", "user": "human", "assistant": "gpt"}
                line = json.dumps({"conversations": [{"from": m[c["role"]], "value": c["content"]}
                                                     for c in conv]})
            else:
                line = json.dumps({"prompt": conv[-2]["content"], "response": conv[-1]["content"]})
            f.write(line + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--dir", default="/tmp/eagle_ray_bench")
    ap.add_argument("--token-workers", type=int, default=0)
    args = ap.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    src = d / f"traffic-{args.lines}.jsonl"
    if not src.exists():
        t0 = time.perf_counter()
        generate(src, args.lines)
        print(f"generated {src} ({src.stat().st_size / 1e6:,.0f} MB) in {time.perf_counter() - t0:.1f}s",
              file=sys.stderr)
    recipe = load_recipe("tiny_cpu")
    annotate = length_annotator(recipe, workers=1)  # loads the tokenizer outside the timed region

    rows = []
    t0 = time.perf_counter()
    r1 = ingest([SourceSpec.parse(str(src))], d / "plain")
    rows.append(("ingest (parse, validate, dedupe, mix, write)", args.lines, time.perf_counter() - t0))
    t0 = time.perf_counter()
    r2 = ingest([SourceSpec.parse(str(src))], d / "tokens", annotate=annotate)
    rows.append(("ingest + token counting (tiny tokenizer)", args.lines, time.perf_counter() - t0))
    assert r1.accepted == r2.accepted
    if args.token_workers:
        from eagle_ray.ops.cluster import init_ray

        init_ray(address="local", num_cpus=args.token_workers, include_dashboard=False)
        par = length_annotator(recipe, workers=args.token_workers)
        t0 = time.perf_counter()
        ingest([SourceSpec.parse(str(src))], d / "tokens-ray", annotate=par)
        rows.append((f"ingest + token counting on {args.token_workers} Ray actors", args.lines,
                     time.perf_counter() - t0))
        same = ((d / "tokens-ray" / "prompts.parquet").read_bytes()
                == (d / "tokens" / "prompts.parquet").read_bytes())
        print(f"prompts.parquet from the Ray actors equals the in-process one: {same}", file=sys.stderr)
        assert same
    t0 = time.perf_counter()
    stats = compute_stats(d / "tokens")
    rows.append(("stats (Polars over prompts.parquet)", r2.accepted, time.perf_counter() - t0))

    print(f"\n{args.lines:,} lines, {src.stat().st_size / 1e6:,.0f} MB; accepted {r2.accepted:,}, "
          f"rejected {r2.rejected:,}, duplicates {r2.duplicates:,}; "
          f"{stats['overall']['total_tokens']:,} tokens\n")
    print(f"| {'step':<46} | {'rows':>10} | {'seconds':>8} | {'rows/s':>10} |")
    print(f"|{'-' * 48}|{'-' * 12}|{'-' * 10}|{'-' * 12}|")
    for name, n, dt in rows:
        print(f"| {name:<46} | {n:>10,} | {dt:>8.2f} | {n / dt:>10,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
