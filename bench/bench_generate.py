"""Generation throughput: the Ray Data pipeline (1 vLLM replica) vs a bare vllm.LLM, same prompts.

    .venv/bin/python bench/bench_generate.py [--prompts 2048] [--max-tokens 128] [--batch-size 64]

Prints completion tokens/s for both, measured two ways: wall clock including start-up
(Ray + actor + engine load), and steady state (generation only: the bare engine's chat templating,
tokenization and generate call; for the pipeline, batches after the first one over the time they took to arrive).
Greedy, so the two runs produce the same tokens (checked).
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--in-flight", type=int, default=16, help="generate.batches_in_flight")
    args = ap.parse_args()

    import pyarrow as pa
    import pyarrow.compute as pc
    import ray
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle_ray.recipes import load_recipe
    from eagle_ray.targets.resolve import resolve_target_path
    from eagle_ray.data.ingest import SourceSpec, ingest
    from eagle_ray.vllm.engine import engine_kwargs
    from eagle_ray.generate.run import generation_dataset
    from eagle_ray.targets.tiny import corpus

    recipe = load_recipe("tiny_cpu", [f"generate.max_tokens={args.max_tokens}",
                                      f"generate.batch_size={args.batch_size}",
                                      "engine.num_cpus_per_replica=2", f"generate.batches_in_flight={args.in_flight}"])  # the replica owns the machine, as the bare run does
    model = str(resolve_target_path(recipe.target))
    tmp = Path(tempfile.mkdtemp(prefix="bench_gen_"))
    lines = [json.dumps({"messages": c}) for c in corpus.conversations(args.prompts * 2, seed=11)]
    (tmp / "in.jsonl").write_text("\n".join(lines) + "\n")
    ingest([SourceSpec.parse(f"{tmp / 'in.jsonl'}:{args.prompts}")], tmp / "prompts")
    table = pa.parquet.read_table(tmp / "prompts" / "prompts.parquet").select(
        ["sample_id", "source", "messages", "reference"])
    tok = AutoTokenizer.from_pretrained(model)

    # --- bare vLLM in this process (chat templating + tokenization timed, as the stage does it)
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(recipe, model))
    t1 = time.perf_counter()
    ids = [tok(tok.apply_chat_template(json.loads(m), tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"] for m in table.column("messages").to_pylist()]
    outs = llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids],
                        SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                       skip_special_tokens=False), use_tqdm=False)
    t2 = time.perf_counter()
    bare_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    bare_ids = {sid: list(o.outputs[0].token_ids)
                for sid, o in zip(table.column("sample_id").to_pylist(), outs)}
    del llm

    # --- the Ray Data pipeline, one replica
    t3 = time.perf_counter()
    ray.init(address="local", num_cpus=3, include_dashboard=False, object_store_memory=512 << 20)
    arrivals, tokens, same = [], [], 0
    for batch in generation_dataset(recipe, table, Path(model)).iter_batches(
            batch_format="pyarrow", batch_size=None):
        arrivals.append(time.perf_counter())
        tokens.append(pc.sum(batch.column("num_completion_tokens")).as_py() or 0)
        for sid, c in zip(batch.column("sample_id").to_pylist(),
                          batch.column("completion_token_ids").to_pylist()):
            same += bare_ids[sid] == c
    t4 = time.perf_counter()
    ray.shutdown()
    ray_tokens = sum(tokens)
    steady = sum(tokens[1:]) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else float("nan")

    rows = [("bare vllm.LLM", bare_tokens, t2 - t0, bare_tokens / (t2 - t0), bare_tokens / (t2 - t1)),
            ("Ray Data pipeline, 1 replica", ray_tokens, t4 - t3, ray_tokens / (t4 - t3), steady)]
    print(f"\n{args.prompts} prompts, max_tokens {args.max_tokens}, batch_size {args.batch_size}; "
          f"identical greedy outputs: {same}/{args.prompts}\n")
    print(f"| {'path':<30} | {'tokens':>8} | {'wall s':>7} | {'tok/s incl. start':>17} | {'tok/s steady':>12} |")
    print(f"|{'-' * 32}|{'-' * 10}|{'-' * 9}|{'-' * 19}|{'-' * 14}|")
    for name, n, wall, a, b in rows:
        print(f"| {name:<30} | {n:>8,} | {wall:>7.1f} | {a:>17,.0f} | {b:>12,.0f} |")
    print(f"\nratio pipeline/bare: incl. start-up {rows[1][3] / rows[0][3]:.2f}, "
          f"steady state {rows[1][4] / rows[0][4]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
