"""`make demo`: the end-to-end job on the tiny CPU target, submitted with `ray job submit`.

Starts a local Ray head from this environment (dashboard on 127.0.0.1) unless RAY_ADDRESS
names a cluster (its job-submission address, e.g. http://HEAD:8265, as `ray job submit` takes), submits jobs/end_to_end.py, prints the dashboard address, follows the job's
logs, prints the evaluation table and stops only the head it started. Submitting again with
the same --out resumes a stopped or failed job (finished steps are skipped).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

from eagle_ray.job import launch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/demo")
    p.add_argument("--recipe", default="tiny_cpu")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--online", action="store_true", help="train online (no hidden-state store)")
    p.add_argument("--sharegpt", type=int, metavar="N",
                   help="the data: N real conversations drawn (seeded) from the installed ShareGPT "
                        "V3 file (requirements/real.txt), instead of the recipe's sample data")
    p.add_argument("--init-from", metavar="DRAFTER_DIR",
                   help="fine-tune this published drafter (e.g. out/demo/drafter) instead of "
                        "training from scratch")
    args = p.parse_args(argv)
    if args.init_from:
        args.set.append(f"train.init_from={Path(args.init_from).resolve()}")
    out = Path(args.out).resolve()
    # One token-authentication mode for the head and for every job command sent to it.
    os.environ.update(launch.auth_env())

    head = None
    address = os.environ.get("RAY_ADDRESS")
    if address:
        print(f"demo: submitting to the cluster at RAY_ADDRESS={address}")
    else:
        print("demo: starting a local Ray head (dashboard on 127.0.0.1) ...", flush=True)
        head = launch.start_head(dashboard_port=None if launch_port_busy(8265) else 8265)
        address = head.dashboard_url
    try:
        print(f"demo: Ray dashboard: {address}", flush=True)
        sid = f"eagle-ray-demo-{uuid.uuid4().hex[:8]}"
        t0 = time.time()
        data = []
        if args.sharegpt:
            from eagle_ray.data.sharegpt import installed_sharegpt_file

            data = [f"{installed_sharegpt_file()}:{args.sharegpt}::sharegpt"]
        launch.submit(launch.job_args(out, recipe=args.recipe, sets=args.set, online=args.online,
                                      data=data), address, sid)
        print(f"demo: submitted job {sid}; following its logs (Ctrl-C stops following, not the job)",
              flush=True)
        print(f"demo: resize the extractor pool while it runs: .venv/bin/eagle-ray scale extract 2 "
              f"--job {sid}" + (f" --address {head.gcs_address}" if head else ""), flush=True)
        try:
            launch.ray_job(["logs", "--follow", sid], address)
        except KeyboardInterrupt:
            print(f"\ndemo: stopped following; the job goes on: `ray job logs {sid} --address {address}`"
                  + (f"; stop its Ray head with `kill -- -{head.pgid}`" if head else ""))
            head = None  # leave the head running for the job
            return 130
        st = launch.wait(address, sid)
        print(f"demo: job {sid} {st} in {time.time() - t0:.0f} s; outputs in {out}")
        report = out / "evaluate" / "report.md"
        if st == "SUCCEEDED" and report.exists():
            # The headline and the two tables; the distribution test and the per-source
            # table stay in the file.
            text = report.read_text()
            print(example_text(out))
            cut = text.find("\nOutput distribution")
            print("\n" + (text[:cut].rstrip() + f"\n\n(the whole report: {report})" if cut > 0 else text))
            return 0
        return 1
    finally:
        if head is not None:
            head.stop()
            print(f"demo: stopped the Ray head it started (process group {head.pgid})")


def example_text(out: Path, width: int = 400) -> str:
    """One regenerated sample of the run, as text: the last user message and the target's
    answer that the drafter was trained on (the first in the table; cut to `width`)."""
    import json

    import pyarrow.parquet as pq

    conv = out / "generate" / "conversations.parquet"
    if not conv.exists():
        return ""
    rows = pq.read_table(conv, columns=["status", "messages", "completion_text"]).to_pylist()
    row = next((r for r in rows if r["status"] == "ok" and r["completion_text"]), None)
    if row is None:
        return ""
    users = [m for m in json.loads(row["messages"]) if m.get("role") == "user"]
    question = users[-1]["content"] if users else ""
    if not isinstance(question, str):
        question = " ".join(p.get("text", "") for p in question if isinstance(p, dict))

    def cut(t: str) -> str:
        t = " ".join(t.split())
        return t if len(t) <= width else t[:width] + " ..."
    return (f"\nOne sample the drafter trained on ({conv}):\n  user:   {cut(question)}\n"
            f"  target: {cut(row['completion_text'])}")


def launch_port_busy(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


if __name__ == "__main__":
    sys.exit(main())
