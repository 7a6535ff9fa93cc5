"""Streamed generate+extract vs the staged commands, on the tiny target (regenerate mode).

For each prompt count: wall time of the streamed run (eagle_ray/stream/run.py) with separate
pools and with the colocated placement (one engine generates and captures), of generate and
extract run back to back, and peak memory: driver RSS and object-store bytes in use (Ray's
plasma usage, polled every 0.2 s). Each run is its own process with its own local Ray, so
start-up is included in every figure and nothing is shared between runs.

    .venv/bin/python bench/bench_stream.py --prompts 32 128
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETS = ["generate.max_tokens=32", "data.max_seq_len=256", "extract.batch_size=8",
        "generate.batch_size=8"]


def child(mode: str, n: int, d: Path) -> dict:
    import resource
    import threading

    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    from eagle_ray.recipes import load_recipe
    from eagle_ray.data.ingest import SourceSpec, ingest
    from eagle_ray.targets.tiny import corpus

    (d / "in.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n"
                                        for c in corpus.conversations(n, seed=9)))
    ingest([SourceSpec.parse(str(d / "in.jsonl"))], d / "prompts")
    r = load_recipe("tiny_cpu", SETS)
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=512 << 20)
    peak = [0]
    stop = threading.Event()

    def poll():
        state = get_state_from_address(ray.get_runtime_context().gcs_address)
        while not stop.is_set():
            reply = get_memory_info_reply(state)
            peak[0] = max(peak[0], reply.store_stats.object_store_bytes_used)
            time.sleep(0.2)

    threading.Thread(target=poll, daemon=True).start()
    out = {}
    t0 = time.time()
    if mode in ("streamed", "colocated"):
        from eagle_ray.config import apply_overrides
        from eagle_ray.stream.run import run_generate_extract

        placement = "colocated" if mode == "colocated" else "separate"
        run_generate_extract(apply_overrides(r, {"extract.placement": placement}),
                             d / "prompts", d / "gen", d / "store")
    else:
        from eagle_ray.extract.run import run_extract
        from eagle_ray.generate.run import run_generate

        run_generate(r, d / "prompts", d / "gen")
        out["generate_s"] = time.time() - t0
        t1 = time.time()
        run_extract(r, d / "gen", d / "store")
        out["extract_s"] = time.time() - t1
    out["wall_s"] = time.time() - t0
    stop.set()
    out["driver_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["object_store_peak_mib"] = peak[0] / 2**20
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, nargs="+", default=[32, 128])
    p.add_argument("--child", nargs=3, metavar=("MODE", "N", "DIR"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        res = child(a.child[0], int(a.child[1]), Path(a.child[2]))
        print("RESULT " + json.dumps(res))
        return
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    rows = []
    for n in a.prompts:
        r = {}
        for mode in ("streamed", "colocated", "staged"):
            with tempfile.TemporaryDirectory() as d:
                proc = subprocess.run([sys.executable, __file__, "--child", mode, str(n), d],
                                      env=env, capture_output=True, text=True)
                line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
                if proc.returncode or not line:
                    sys.exit(f"{mode} n={n} failed:\n{proc.stderr[-3000:]}")
                r[mode] = json.loads(line[0][7:])
        rows.append((n, r))
    print("| prompts | streamed (separate pools) s | colocated s | generate s | extract s | staged total s "
          "| streamed / slower stage | driver RSS MiB streamed / colocated / staged "
          "| object store peak MiB streamed / colocated / staged |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, r in rows:
        s, c, g = r["streamed"], r["colocated"], r["staged"]
        slower = max(g["generate_s"], g["extract_s"])
        print(f"| {n} | {s['wall_s']:.1f} | {c['wall_s']:.1f} | {g['generate_s']:.1f} | "
              f"{g['extract_s']:.1f} | {g['wall_s']:.1f} | {s['wall_s'] / slower:.2f} | "
              f"{s['driver_rss_mib']:.0f} / {c['driver_rss_mib']:.0f} / {g['driver_rss_mib']:.0f} | "
              f"{s['object_store_peak_mib']:.2f} / {c['object_store_peak_mib']:.2f} / "
              f"{g['object_store_peak_mib']:.2f} |")


if __name__ == "__main__":
    main()
