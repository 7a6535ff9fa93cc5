"""Long agent sessions in a training window: what each data.long_sessions policy keeps.

    .venv/bin/python bench/bench_long_sessions.py [--data examples/data/agentic.jsonl] [--windows 768,1024,1536]

Ingests the sessions, then runs keep-logged tokenization (generate's LoggedUDF, in this
process, on the tiny target's Hermes-style template) with each policy and window, for
train_turns=last and =all, and prints per policy and window: sessions longer than the window,
sessions cut (cut_history), sessions still end-truncated, sessions whose final turn is whole
inside the window (last), and loss tokens in the window (last / all).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[1] / "examples" / "data" / "agentic.jsonl"))
    p.add_argument("--windows", default="768,1024,1536")
    args = p.parse_args(argv)

    import pyarrow.parquet as pq

    from eagle_ray.data.ingest import SourceSpec, ingest
    from eagle_ray.generate.stage import LoggedUDF
    from eagle_ray.recipes import load_recipe
    from eagle_ray.targets.resolve import resolve_target_path

    tmp = Path(tempfile.mkdtemp())
    ingest([SourceSpec.parse(args.data)], tmp / "prompts")
    prompts = pq.read_table(tmp / "prompts" / "prompts.parquet")
    rows = []
    for w in (int(x) for x in args.windows.split(",")):
        for policy in ("truncate_end", "cut_history"):
            got = {}
            for turns in ("last", "all"):
                r = load_recipe("tiny_cpu", ["generate.mode=keep_logged", f"data.train_turns={turns}",
                                             f"data.max_seq_len={w}", f"data.long_sessions={policy}"])
                t = LoggedUDF(r, str(resolve_target_path(r.target)))(prompts).to_pylist()
                ok = [x for x in t if x["status"] == "ok"]
                got[turns] = ok
            last, every = got["last"], got["all"]
            rows.append((w, policy, len(last),
                         sum(1 for x in last if x["truncated"] or x["history_cut_tokens"]),
                         sum(1 for x in last if x["history_cut_tokens"]),
                         sum(1 for x in last if x["truncated"]),
                         sum(1 for x in last if x["num_loss_tokens"] == x["num_completion_tokens"]),
                         sum(x["num_loss_tokens"] for x in last), sum(x["num_loss_tokens"] for x in every)))
    head = ("window", "policy", "sessions", "longer", "cut", "truncated", "final turn whole",
            "loss tokens (last)", "loss tokens (all)")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(f"{v:,}" if isinstance(v, int) else str(v) for v in r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
