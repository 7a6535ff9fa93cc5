"""Writes the notebooks of this directory from the cells below, without outputs.

    .venv/bin/python notebooks/build.py           # (re)write the .ipynb files
    .venv/bin/python notebooks/build.py --check   # exit 1 when a committed notebook differs

Edit the cells here, not in Jupyter, then run the first command: the .ipynb files are
generated (fixed cell ids, no outputs, no execution counts), so they diff cleanly and
tests/integration/test_notebooks.py can check that they equal what this script writes and
execute them with a real kernel.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def md(text: str):
    return new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(text: str):
    return new_code_cell(textwrap.dedent(text).strip("\n"))


# ---------------------------------------------------------------------------------------------
# 01: data and storage plan
# ---------------------------------------------------------------------------------------------

NB01 = [
    md(r"""
    # 1. Data and storage plan

    Ingest conversation logs (by default the bundled sample data: a small "personal" log plus
    600 conversations sampled from a general ShareGPT file), look at what was accepted and why
    the rest was not, the token statistics per source, the length distribution, and the
    hidden-state storage plan for the tiny recipe and for the production Kimi-K2.5 recipe.
    No Ray, no GPU: it runs in seconds on a laptop.

    | environment variable | default | meaning |
    |---|---|---|
    | `EAGLE_RAY_NB_OUT` | a new temporary directory | where `ingest/` is written |
    | `EAGLE_RAY_NB_RECIPE` | `tiny_cpu` | recipe whose tokenizer counts the tokens |
    | `EAGLE_RAY_NB_DATA` | `eagle_ray.pipeline.SAMPLE_DATA` | comma-separated `PATH[:COUNT_OR_FRACTION]` sources, as `eagle-ray ingest --input` takes them |
    | `EAGLE_RAY_NB_KIMI_SAMPLES` | `100000` | conversations planned for Kimi-K2.5 |
    | `EAGLE_RAY_NB_KIMI_AVG_TOKENS` | `3000` | their average length in Kimi tokens |
    | `EAGLE_RAY_NB_KIMI_FREE_TB` | `12` | free space (TB) on the volume the Kimi store goes to |

    The same figures come from the CLI: `eagle-ray ingest`, `eagle-ray stats`, `eagle-ray plan`.
    """),
    code(r"""
    import json
    import os
    import tempfile
    import warnings
    from pathlib import Path

    import matplotlib.pyplot as plt
    import numpy as np
    import polars as pl

    from eagle_ray.config import load_recipe
    from eagle_ray.pipeline import SAMPLE_DATA

    OUT = Path(os.environ.get("EAGLE_RAY_NB_OUT") or tempfile.mkdtemp(prefix="eagle-ray-nb01-"))
    RECIPE = os.environ.get("EAGLE_RAY_NB_RECIPE", "tiny_cpu")
    DATA = [s.strip() for s in os.environ.get("EAGLE_RAY_NB_DATA", "").split(",") if s.strip()] or SAMPLE_DATA
    KIMI_SAMPLES = int(os.environ.get("EAGLE_RAY_NB_KIMI_SAMPLES", "100000"))
    KIMI_AVG_TOKENS = float(os.environ.get("EAGLE_RAY_NB_KIMI_AVG_TOKENS", "3000"))
    KIMI_FREE_TB = float(os.environ.get("EAGLE_RAY_NB_KIMI_FREE_TB", "12"))

    pl.Config.set_tbl_cols(-1)
    pl.Config.set_tbl_width_chars(200)
    pl.Config.set_fmt_str_lengths(60)
    pl.Config.set_tbl_hide_dataframe_shape(True)
    warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, imported by transformers
    recipe = load_recipe(RECIPE)
    print(f"recipe {recipe.name}, output {OUT}")
    for d in DATA:
        print("source", d)
    """),
    md(r"""
    ## Ingest

    Every input line ends in exactly one place: accepted (`prompts.parquet`), an exact
    duplicate of an earlier conversation (`duplicates.jsonl`), rejected with a reason
    (`rejects.jsonl`: bad JSON, unknown role, empty content, ...) or sampled out
    (`sampled_out.jsonl`, when a source is given as `PATH:N` or `PATH:FRACTION`). Sample ids
    are content hashes, so ingesting again gives the same ids.
    """),
    code(r"""
    from eagle_ray.data.ingest import SourceSpec, ingest
    from eagle_ray.data.tokenize import length_annotator

    ingest_dir = OUT / "ingest"
    ingest([SourceSpec.parse(s) for s in DATA], ingest_dir, seed=recipe.data.seed,
           annotate=length_annotator(recipe))
    report = json.loads((ingest_dir / "report.json").read_text())
    COUNTS = ["lines_read", "accepted", "duplicates", "rejected", "sampled_out"]
    display(pl.DataFrame([{"source": "ALL", **{k: report[k] for k in COUNTS}}]
                         + [{"source": Path(p).name, **{k: v[k] for k in COUNTS}}
                            for p, v in report["per_source"].items()]))
    print(f"accepted {report['accepted']:,} + duplicates {report['duplicates']:,} + rejected "
          f"{report['rejected']:,} + sampled out {report['sampled_out']:,} = lines read "
          f"{report['lines_read']:,}: {'holds' if report['invariant']['holds'] else 'BROKEN'}")
    print("reject reasons:", report["reject_reasons"])
    for line in (ingest_dir / "rejects.jsonl").read_text().splitlines()[:5]:
        r = json.loads(line)
        print(f"  rejected {Path(r['source']).name} line {r['line']}: {r['reason']}")
    """),
    md(r"""
    ## Token statistics per source

    Counted with the recipe's tokenizer over the chat template, exactly as the target will see
    the conversation: `total_tokens` is prompt + final answer (what extraction runs the
    target's prefill over), `loss_tokens` the tokens the drafter learns to predict (the final
    assistant turn: `<think>` block, answer, end-of-turn), `truncated` the samples longer
    than `data.max_seq_len` (cut from the end).
    """),
    code(r"""
    from eagle_ray.data.stats import compute_stats, token_lengths

    stats = compute_stats(ingest_dir)
    display(pl.DataFrame([{"source": "ALL", **stats["overall"]}]
                         + [{"source": Path(s).name, **v} for s, v in stats["per_source"].items()]))
    """),
    code(r"""
    table = pl.read_parquet(ingest_dir / "prompts.parquet", columns=["source", "num_tokens", "num_loss_tokens"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    for ax, col, title in ((axes[0], "num_tokens", "tokens per sample (prompt + answer)"),
                           (axes[1], "num_loss_tokens", "loss tokens per sample (final answer)")):
        bins = np.histogram_bin_edges(table[col].to_numpy(), bins=40)
        for part in table.partition_by("source", maintain_order=True):
            ax.hist(part[col].to_numpy(), bins=bins, alpha=0.6,
                    label=f"{Path(part['source'][0]).name} ({part.height:,})")
        ax.set_title(title)
        ax.set_xlabel("tokens")
        ax.set_ylabel("samples")
        ax.legend()
    axes[0].axvline(recipe.data.max_seq_len, color="k", ls="--", lw=1)
    axes[0].text(recipe.data.max_seq_len, axes[0].get_ylim()[1] * 0.9, " max_seq_len", fontsize=8)
    plt.tight_layout()
    plt.show()
    """),
    md(r"""
    ## Storage plan: the tiny recipe

    The store keeps, for every token, the target's hidden states at the three auxiliary
    layers plus the final (normed) state: (3 + 1) x H values, plus 5 bytes for the token id
    (int32) and the loss-mask byte. The tiny target has H = 128, so bf16 costs
    4 x 128 x 2 = 1,024 bytes per token. `plan` multiplies that by the ingested token count,
    compares it with the free space where the store will go (less `storage.headroom`), and
    sizes the drafter: tokens per trainable parameter, and the sample count as a fraction of
    the EAGLE-3 paper's ~532K conversations.
    """),
    code(r"""
    from eagle_ray.plan.budget import (format_plan, hidden_bytes_per_token, make_plan,
                                       plan_from_stats, store_bytes_per_token)

    lengths = token_lengths(ingest_dir).to_numpy()
    tiny_plan = plan_from_stats(recipe, stats, lengths, out_dir=OUT / "store")
    print(format_plan(tiny_plan))
    """),
    md(r"""
    The planner lists alternatives only when the store does not fit. To see them on this
    data, the same plan on a volume with 60% of the space it needs: fewer samples, a shorter
    `max_seq_len` priced on the real length distribution above (every sample truncated at
    that length), and fp8 storage.
    """),
    code(r"""
    small = make_plan(recipe, num_samples=tiny_plan.num_samples, avg_tokens=tiny_plan.avg_tokens,
                      loss_tokens=tiny_plan.loss_tokens, lengths=lengths, out_dir=OUT / "store",
                      free=int(tiny_plan.total_bytes * 0.6 / (1 - recipe.storage.headroom)))
    print(format_plan(small))
    """),
    md(r"""
    ## Storage plan: Kimi-K2.5 (`kimi_k25_8gpu`)

    Kimi-K2.5's text model has H = 7,168 and 61 layers; the recipe captures layers 2, 30
    and 58 plus the final state. In bf16 that is **4 x 7168 x 2 = 57,344 bytes per token**
    (57,349 with the id and mask): a 3,000-token conversation is 172 MB of features, and
    100,000 of them are 17 TB. The recipe has no sample count of its own (it depends on your
    data), so the plan below prices `EAGLE_RAY_NB_KIMI_SAMPLES` conversations of
    `EAGLE_RAY_NB_KIMI_AVG_TOKENS` tokens on a volume with `EAGLE_RAY_NB_KIMI_FREE_TB` TB free,
    the same as `eagle-ray plan --recipe kimi_k25_8gpu --set data.num_samples=... --set
    data.avg_tokens_per_sample=...` run on that volume.
    """),
    code(r"""
    kimi = load_recipe("kimi_k25_8gpu")
    t = kimi.target
    layers = len(t.resolved_aux_layer_ids) + 1
    for dtype in ("bf16", "fp8_e4m3"):
        print(f"{dtype:>9}: {layers} x {t.hidden_size:,} x {'2' if dtype == 'bf16' else '1 (+ 4-byte scale per layer)'}"
              f" = {hidden_bytes_per_token(t, dtype):,} bytes/token of features, "
              f"{store_bytes_per_token(t, dtype):,} with id and mask")
    kimi_plan = make_plan(kimi, num_samples=KIMI_SAMPLES, avg_tokens=KIMI_AVG_TOKENS,
                          out_dir=kimi.storage.out_dir, free=int(KIMI_FREE_TB * 1e12))
    print()
    print(format_plan(kimi_plan))
    """),
    code(r"""
    TB = 1e12
    options = [{"option": f"as planned ({kimi_plan.dtype}, max_seq_len {kimi_plan.max_seq_len:,})",
                "samples": kimi_plan.num_samples, "max_seq_len": kimi_plan.max_seq_len,
                "store_TB": round(kimi_plan.total_bytes / TB, 2), "fits": kimi_plan.fits}]
    for a in kimi_plan.alternatives:
        options.append({"option": a["kind"], "samples": a["num_samples"], "max_seq_len": a["max_seq_len"],
                        "store_TB": round(a["bytes"] / TB, 2), "fits": a.get("fits", True)})
    display(pl.DataFrame(options))

    fig, ax = plt.subplots(figsize=(9, 3))
    ax.barh([o["option"] for o in options], [o["store_TB"] for o in options],
            color=["tab:green" if o["fits"] else "tab:red" for o in options])
    ax.axvline(kimi_plan.usable_bytes / TB, color="k", ls="--", lw=1)
    ax.text(kimi_plan.usable_bytes / TB, -0.6, " usable", fontsize=8)
    ax.set_xlabel("store size (TB)")
    ax.invert_yaxis()
    plt.tight_layout()
    plt.show()
    """),
    md(r"""
    What the figures mean:

    - **bytes / token**: the price of one token in the store, fixed by the target (H, the
      number of captured layers) and `storage.dtype`. It does not depend on the data.
    - **store size** = tokens x bytes / token; **fits** compares it with the free space less
      the headroom; **short by** is how much is missing. Every writing stage runs the same
      check and refuses to start when the plan misses.
    - **fewer_samples**: the most samples of the average length that fit at the current
      `max_seq_len`; a smaller store, less training data.
    - **shorter_max_seq_len**: the longest `max_seq_len` at which every sample fits.
      Samples are cut from the end, so long conversations lose the end of their final answer
      (the part the drafter learns from). Given only an average length (as here) it is an
      estimate that caps the average; with `--stats` of a real ingest it is priced on the
      real length distribution, as in the tiny example above.
    - **storage.dtype=fp8_e4m3**: one byte per value plus a 4-byte scale per token and layer:
      28,688 bytes per token for Kimi-K2.5, half of bf16, at the cost of precision in the
      features the drafter trains on (`eagle-ray check` compares what vLLM serves with what
      was stored).
    - **drafter trainable params / tokens per param / paper scale**: whether the data set is
      large enough for a drafter this size (one decoder layer at the target's width plus its
      fc and draft head), against the EAGLE-3 paper's ~532K conversations.
    """),
]


# ---------------------------------------------------------------------------------------------
# 02: operate a running job
# ---------------------------------------------------------------------------------------------

NB02 = [
    md(r"""
    # 2. Operating a running job

    Watch and steer an end-to-end job while it runs: its status and metadata, the tail of its
    log, the stage it is in, its rates on the Prometheus endpoint, and the size of its
    extraction pool, which we change while it runs (`eagle-ray scale extract N` does the
    same from a shell).

    With no `RAY_ADDRESS`, the notebook starts its own local Ray head (own temp dir, free
    ports, dashboard on 127.0.0.1), submits the end-to-end job on the tiny CPU target with
    `ray job submit` (2,400 logged conversations, one per extraction batch, so extraction
    lasts about a minute on 2 cores), and stops that head in the last cell (or when the kernel
    exits, whatever happened in between).

    | environment variable | default | meaning |
    |---|---|---|
    | `RAY_ADDRESS` | unset: start a local head | GCS address of a running cluster (`HEAD_IP:6379`, or `auto` on one of its nodes), as `eagle-ray scale --address` takes it |
    | `EAGLE_RAY_NB_JOB` | unset: submit the demo job | submission id of the eagle_ray job to operate |
    | `EAGLE_RAY_NB_OUT` | a new temporary directory | where a job this notebook submits writes (on a cluster: shared storage) |
    | `EAGLE_RAY_NB_CONVERSATIONS` | `2400` | conversations that job extracts |
    | `EAGLE_RAY_NB_STOP_JOB` | `1` if the notebook submitted the job, else `0` | stop the job at the end |

    **Dashboard.** The first cell prints the Ray dashboard's address: the Jobs page shows this
    job with its recipe and output directory, Metrics the `eagle_ray_*` panels
    (`grafana/eagle_ray_dashboard.json`), Train the training run. On a cluster launched
    with `cluster.yaml`, `.venv/bin/ray dashboard cluster.yaml` tunnels the loopback-only
    dashboard to http://127.0.0.1:8265; run this notebook on the head node (with
    `RAY_ADDRESS=auto`) so that it can join the cluster as a driver.
    """),
    code(r"""
    import atexit
    import json
    import logging
    import os
    import re
    import tempfile
    import time
    import urllib.request
    import uuid
    import warnings
    from pathlib import Path

    from eagle_ray import launch

    warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, imported by transformers
    logging.getLogger("ray.widgets.util").setLevel(logging.WARNING)  # "Missing packages: ipywidgets"

    ADDRESS = os.environ.get("RAY_ADDRESS") or None
    JOB = os.environ.get("EAGLE_RAY_NB_JOB") or None
    OUT = Path(os.environ.get("EAGLE_RAY_NB_OUT") or tempfile.mkdtemp(prefix="eagle-ray-nb02-"))
    N_CONVERSATIONS = int(os.environ.get("EAGLE_RAY_NB_CONVERSATIONS", "2400"))
    STOP_JOB = os.environ.get("EAGLE_RAY_NB_STOP_JOB", "0" if JOB else "1") == "1"
    # The local head's settings (as tests/integration/test_job.py): metrics pushed every second.
    ENV = {"RAY_AUTH_MODE": "disabled", "RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S": "300",
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "RAY_metrics_report_interval_ms": "1000"}
    OUT.mkdir(parents=True, exist_ok=True)

    head = None
    if ADDRESS is None:
        head = launch.start_head(num_cpus=4, object_store_bytes=512 << 20, env=ENV)
        atexit.register(head.stop)  # the kernel exiting stops the head, even after a failed cell
        (OUT / "head.json").write_text(json.dumps({"pgid": head.pgid, "temp_dir": str(head.temp_dir)}))
        os.environ["RAY_AUTH_MODE"] = ENV["RAY_AUTH_MODE"]  # this kernel joins that head as a driver
        GCS = head.gcs_address
        print(f"started a local Ray head (process group {head.pgid}, temp dir {head.temp_dir})")
    else:
        GCS = ADDRESS

    import ray

    ctx = ray.init(address=GCS, namespace="eagle_ray", log_to_driver=False)
    if head is not None:
        DASHBOARD, METRICS_URLS = head.dashboard_url, [head.metrics_url]
    else:  # every node's Prometheus endpoint (replicas report where they run)
        DASHBOARD = "http://" + ctx.dashboard_url
        METRICS_URLS = [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
                        for n in ray.nodes() if n["Alive"]]
    print(f"GCS {GCS}")
    print(f"Ray dashboard: {DASHBOARD}")
    print(f"Prometheus endpoints: {', '.join(METRICS_URLS)}")
    """),
    md(r"""
    ## Submit the job

    Skipped when `EAGLE_RAY_NB_JOB` names a running job. The entrypoint is this environment's
    interpreter running `jobs/end_to_end.py` (`launch.job_args`), the working directory is the
    repository (`launch.submit`, the `ray job submit` users run), and the submission metadata
    carries the recipe, output directory and `--set` overrides to the dashboard's Jobs page.
    """),
    code(r"""
    from eagle_ray.tiny import corpus

    SUBMITTED = JOB is None
    if SUBMITTED:
        data = OUT / "conversations.jsonl"
        data.write_text("".join(json.dumps({"messages": c}) + "\n"
                                for c in corpus.conversations(N_CONVERSATIONS, seed=34)))
        SETS = ["generate.mode=keep_logged", "generate.max_tokens=24", "data.max_seq_len=96",
                "storage.dtype=fp32", "extract.batch_size=1", "extract.num_cpus_per_replica=0.5",
                "extract.min_replicas=1", "extract.max_replicas=1", "train.max_steps=4",
                "train.num_workers=1", "train.ckpt_interval=2", "train.eval_interval=2",
                "train.log_interval=2"]
        JOB = f"nb-operate-{uuid.uuid4().hex[:8]}"
        t_submit = time.time()
        launch.submit(launch.job_args(OUT / "run", sets=SETS, data=[str(data)]), DASHBOARD, JOB,
                      env_vars=ENV if head is not None else None)
        print(f"submitted job {JOB} ({N_CONVERSATIONS:,} conversations) -> {OUT / 'run'}")
    print(f"operating job {JOB}")
    """),
    md(r"""
    ## Wait for extraction

    The driver ingests, then streams the conversations through the extraction pool; the first
    committed index part in `OUT/store/index` means the pool is running. `stage_of` reads the
    stage from the log: the pipeline prints one line per finished step (`ingest: accepted ...`,
    `generate+extract (...)`, `train: step ...`, `export + check: ...`, `evaluate: ...`,
    `summary: ...`).
    """),
    code(r"""
    from ray.job_submission import JobStatus, JobSubmissionClient

    from eagle_ray.store.reader import read_index

    client = JobSubmissionClient(DASHBOARD)
    RUN = Path(client.get_job_info(JOB).metadata["out"])
    STEPS = [("ingest: accepted", "ingest"), ("generate+extract (", "generate+extract"),
             ("train: step", "train"), ("export + check:", "export + check"),
             ("evaluate: mean acceptance", "evaluate"), ("summary: ", "summary")]
    ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal colours in the log


    def stage_of(logs: str, status) -> str:
        if status == JobStatus.SUCCEEDED:
            return "finished"
        lines = ANSI.sub("", logs).splitlines()
        for marker, name in STEPS:
            if not any(line.startswith(marker) for line in lines):
                return name if status in (JobStatus.PENDING, JobStatus.RUNNING) else f"{name} ({status.value})"
        return "summary"


    def committed() -> int:
        return len(read_index(RUN / "store")) if (RUN / "store").exists() else 0


    def accepted() -> int | None:
        report = RUN / "ingest" / "report.json"
        return json.loads(report.read_text())["accepted"] if report.exists() else None


    t0 = time.time()
    while committed() == 0:  # until extraction commits (or the job is past it)
        status = client.get_job_status(JOB)
        if status not in (JobStatus.PENDING, JobStatus.RUNNING):
            raise RuntimeError(f"job {JOB} is {status.value}:\n" + client.get_job_logs(JOB)[-3000:])
        if stage_of(client.get_job_logs(JOB), status) not in ("ingest", "generate+extract"):
            break
        if time.time() - t0 > 600:
            raise TimeoutError(f"job {JOB}: no sample committed after 600 s")
        time.sleep(1)
    print(f"after {time.time() - t0:.0f} s: stage {stage_of(client.get_job_logs(JOB), client.get_job_status(JOB))}, "
          f"{committed():,} of {accepted() or 0:,} samples committed")
    """),
    md(r"""
    ## Status, metadata, log, stage

    What `ray job status JOB` and the dashboard's Jobs page show, plus the last lines of the
    driver's log (`ray job logs JOB`).
    """),
    code(r"""
    info = client.get_job_info(JOB)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.start_time / 1000))
    for key, value in [("submission id", info.submission_id), ("Ray job id", info.job_id),
                       ("status", info.status.value), ("message", info.message), ("started", started),
                       ("driver", f"{info.driver_info.node_ip_address} pid {info.driver_info.pid}"
                        if info.driver_info else "-"),
                       ("entrypoint", info.entrypoint)] + [(f"metadata {k}", v) for k, v in info.metadata.items()]:
        print(f"{key:<22} {value}")
    logs = ANSI.sub("", client.get_job_logs(JOB))
    print(f"\nstage: {stage_of(logs, info.status)}; store: {committed():,} of {accepted() or 0:,} samples committed")
    # Only the driver's own lines: those of the job's actors start with "(ActorName pid=...)",
    # Ray Data's progress reports (the dashboard's Data page shows them) name logging_progress.
    lines = logs.splitlines()
    driver_lines = [line for line in lines if not line.startswith("(") and "logging_progress.py" not in line
                    and not line.startswith("Loading safetensors")]
    print(f"\nlog tail ({len(lines):,} lines; driver only, without Ray Data's progress reports):")
    print("\n".join(driver_lines[-15:]))
    """),
    md(r"""
    ## Rates from the Prometheus endpoint

    Every `eagle_ray_*` metric is tagged with the Ray job id and the stage
    (`eagle_ray/metrics.py`); Ray exports a metric `NAME` as `ray_NAME`, and a counter as
    `ray_NAME_total`. Two scrapes ten seconds apart give the counters' rates; gauges (replicas,
    batches in flight per replica, pool bounds) are shown as they are. Grafana and the
    dashboard's Metrics view read the same endpoint.
    """),
    code(r"""
    from eagle_ray.metrics import METRICS

    _LINE = re.compile(r'^(?:ray_)?(eagle_ray_\w+?)(?:_total)?\{(.*)\} ([0-9.eE+-]+)$')
    JOB_ID = client.get_job_info(JOB).job_id


    def scrape(job_id: str) -> dict[tuple, float]:
        # {(metric, our tags): value} of one job, summed over processes and nodes
        out: dict[tuple, float] = {}
        for url in METRICS_URLS:
            for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
                m = _LINE.match(line)
                if not m or m.group(1) not in METRICS:
                    continue
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
                if labels.get("job") != job_id:
                    continue
                key = (m.group(1), tuple((k, labels.get(k, "")) for k in METRICS[m.group(1)][2]))
                out[key] = out.get(key, 0.0) + float(m.group(3))
        return out


    def rates(seconds: float = 10.0) -> None:
        t1, a = time.time(), scrape(JOB_ID)
        time.sleep(seconds)
        t2, b = time.time(), scrape(JOB_ID)
        rows = []
        for key in sorted(b):
            name, tags = key
            kind = METRICS[name][0]
            rate = (b[key] - a.get(key, 0.0)) / (t2 - t1) if kind == "counter" else None
            tag = ", ".join(f"{k}={v}" for k, v in tags if v)
            rows.append(f"{name:<34} {tag:<40} {b[key]:>14,.1f} {'' if rate is None else f'{rate:>10,.1f}/s'}")
        print(f"{'metric':<34} {'tags':<40} {'value':>14} {'rate':>12}")
        print("\n".join(rows) if rows else "(no eagle_ray metric of this job yet)")


    rates()
    """),
    md(r"""
    ## The pools, and scaling extraction while it runs

    `eagle_ray.control.scale(stage, n, job)` is what `eagle-ray scale` calls: it sets the
    desired size on the job's control actor (`control:<job>`, namespace `eagle_ray`), and the
    job's Ray Data executor resizes the running pool between scheduling steps. Scaling up
    starts new replicas (the running one keeps its loaded model); scaling down drains the
    least busy replica: it takes no new batch, finishes and commits the ones it holds, then is
    released. Nothing is lost or extracted twice. With `wait_s` the call waits until the pool
    has the asked size. `scale(None, None, job)` only shows the pools.
    """),
    code(r"""
    from eagle_ray.control import scale

    pools = scale(None, None, JOB)
    """),
    code(r"""
    t0 = time.time()
    scale("extract", 2, JOB, wait_s=90)
    print(f"({time.time() - t0:.1f} s; {committed():,} samples committed)")
    """),
    code(r"""
    rates(5)
    """),
    code(r"""
    t0 = time.time()
    scale("extract", 1, JOB, wait_s=90)
    print(f"({time.time() - t0:.1f} s; {committed():,} samples committed)")
    """),
    md(r"""
    ## Stop the job

    `client.stop_job` (`ray job stop JOB`) ends the driver; the store keeps every committed
    sample, and submitting the same command again resumes where it stopped (finished steps
    are skipped, extraction skips committed samples). Skipped for a job this notebook did not
    submit unless `EAGLE_RAY_NB_STOP_JOB=1`.
    """),
    code(r"""
    if STOP_JOB:
        client.stop_job(JOB)
        final = launch.wait(DASHBOARD, JOB, 120)
        print(f"job {JOB}: {final}; {committed():,} of {accepted() or 0:,} samples committed in {RUN / 'store'}")
    else:
        print(f"job {JOB} left running ({client.get_job_status(JOB).value})")
    """),
    md(r"""
    ## Clean up

    Disconnect from Ray and, only if this notebook started it, stop the local head (its
    process group: never `ray stop`, which would end every Ray on the machine).
    """),
    code(r"""
    ray.shutdown()
    if head is not None:
        head.stop()
        atexit.unregister(head.stop)
        print(f"stopped the local Ray head (process group {head.pgid})")
    """),
]


# ---------------------------------------------------------------------------------------------
# 03: results of a finished run
# ---------------------------------------------------------------------------------------------

NB03 = [
    md(r"""
    # 3. Results of a finished run

    Training curves, acceptance per draft position (trained drafter vs an untrained one vs
    vLLM's n-gram speculation, measured offline on held-out store samples and online in
    vLLM), speed, and the train/serve feature check, all read from a finished run directory.
    No Ray, no GPU.

    | environment variable | default | meaning |
    |---|---|---|
    | `EAGLE_RAY_NB_RUN` | `out/demo` (what `make demo` writes; relative to the repository) | the run's output directory (`--out` of the job) |

    The directory holds `train/metrics.jsonl` (written by rank 0 during training),
    `evaluate/report.json` (and `report.md`, `acceptance.png`), `check.json` and
    `summary.json`.
    """),
    code(r"""
    import json
    import os
    from pathlib import Path

    import matplotlib.pyplot as plt
    import numpy as np
    import polars as pl
    from IPython.display import Markdown

    from eagle_ray.pipeline import REPO_ROOT

    RUN = Path(os.environ.get("EAGLE_RAY_NB_RUN") or "out/demo").expanduser()
    if not RUN.is_absolute() and not RUN.exists():
        RUN = REPO_ROOT / RUN
    if not (RUN / "evaluate" / "report.json").exists():
        raise FileNotFoundError(f"{RUN} holds no finished run (evaluate/report.json): run `make demo` "
                                "or set EAGLE_RAY_NB_RUN to a job's --out directory")
    pl.Config.set_tbl_cols(-1)
    pl.Config.set_tbl_width_chars(200)
    pl.Config.set_tbl_hide_dataframe_shape(True)

    summary = json.loads((RUN / "summary.json").read_text()) if (RUN / "summary.json").exists() else {}
    report = json.loads((RUN / "evaluate" / "report.json").read_text())
    metrics = [json.loads(line) for line in (RUN / "train" / "metrics.jsonl").read_text().splitlines() if line]
    print(f"run {RUN}")
    if summary:
        print(f"recipe {summary['recipe']['name']}, status {summary['status']}, "
              f"{summary['store_verify']['samples']:,} samples in the store, "
              f"trained to step {summary['train'].get('step')}")
        timings = summary.get("timings_s", {})
        if "generate_extract" in timings:  # streamed: one wall time for both steps
            timings = {k: v for k, v in timings.items() if k not in ("generate", "extract")}
        print("wall time per step (s):", {k: round(v) for k, v in timings.items()})
    """),
    md(r"""
    ## Training

    `train/loss` is the training loss (the target's distribution restricted to the draft
    vocabulary as teacher, summed over the TTT steps); `train/acc_stepJ` the top-1 accuracy
    of the drafter's J-th step of training-time test (step 0 predicts from the target's
    features, step J > 0 from its own J previous outputs, as when it drafts J + 1 tokens
    ahead); `val/acc_stepJ` the same on the held-out split, measured at step 0 (untrained) and
    every `train.eval_interval` steps.
    """),
    code(r"""
    train_rows = [m for m in metrics if "train/loss" in m]
    val_rows = [m for m in metrics if "val/acc_step0" in m]
    ttt = sorted(int(k[len("train/acc_step"):]) for k in train_rows[-1] if k.startswith("train/acc_step")) if train_rows else []

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    steps = [m["step"] for m in train_rows]
    axes[0].plot(steps, [m["train/loss"] for m in train_rows], marker=".")
    axes[0].set_yscale("log")
    axes[0].set_title("training loss")
    for j in ttt:
        axes[1].plot(steps, [m[f"train/acc_step{j}"] for m in train_rows], marker=".", label=f"TTT step {j}")
        axes[2].plot([m["step"] for m in val_rows], [m[f"val/acc_step{j}"] for m in val_rows], marker="o",
                     label=f"TTT step {j}")
    axes[1].set_title("training accuracy per TTT step")
    axes[2].set_title("held-out accuracy per TTT step")
    for ax in axes:
        ax.set_xlabel("optimizer step")
    for ax in axes[1:]:
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    plt.tight_layout()
    plt.show()

    display(pl.DataFrame([{"step": m["step"], **{f"val acc {j}": round(m[f"val/acc_step{j}"], 3) for j in ttt}}
                          for m in val_rows]))
    """),
    md(r"""
    ## Acceptance per draft position

    The drafter proposes k tokens per step; position j's acceptance is the share of drafts
    whose first j + 1 tokens were all accepted. The mean acceptance length is pooled over
    drafts the way vLLM pools it, 1 + accepted / drafts (the 1 is the token the target emits
    itself), so it runs from 1 (nothing accepted) to k + 1. **Offline**: simulated chain
    drafting on held-out store samples (the target's stored features and argmax). **Online**:
    real speculative decoding in vLLM on held-out prompts, greedy, counted by vLLM; the
    outputs with speculation must equal the outputs without.
    """),
    code(r"""
    runs = [("offline, trained", report["offline"]), ("offline, untrained", report["offline_untrained"]),
            ("online, trained", report["online"]), ("online, untrained", report["untrained"]),
            ("online, n-gram", report["ngram"])]
    k = report["k"]
    display(pl.DataFrame([{"run": name, "mean acceptance length": round(r["mean_acceptance_length"], 3),
                           "drafts": r["num_drafts"],
                           **{f"pos {j}": round(p, 3) for j, p in enumerate(r["per_position_acceptance"])}}
                          for name, r in runs]))
    print(f"online mean acceptance length {report['online']['mean_acceptance_length']:.3f} with k = {k} "
          f"on {report['prompts']} held-out prompts (n-gram {report['ngram']['mean_acceptance_length']:.3f}, "
          f"untrained {report['untrained']['mean_acceptance_length']:.3f}); offline "
          f"{report['offline']['mean_acceptance_length']:.3f}, gap {report['offline_online_gap']:.3f}")

    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(runs)
    for i, (name, r) in enumerate(runs):
        ax.bar(np.arange(k) + (i - (len(runs) - 1) / 2) * width, r["per_position_acceptance"], width,
               label=f"{name} ({r['mean_acceptance_length']:.2f})")
    ax.set_xticks(np.arange(k), [f"position {j}" for j in range(k)])
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    ax.set_title("acceptance per draft position (mean acceptance length in brackets)")
    ax.legend(fontsize=8)
    plt.tight_layout()
    plt.show()
    """),
    md(r"""
    ## Speed

    Output tokens per second of each online run and its ratio to the run without speculation,
    same prompts, same engine settings. On the tiny CPU target a drafter step costs about as
    much as a target step, so these ratios say little about a large target on GPUs, where a
    target step is far more expensive than a drafter step and the mean acceptance length
    drives the speedup.
    """),
    code(r"""
    speed = [{"run": name, "output tokens": report[key]["output_tokens"], "seconds": round(report[key]["seconds"], 2),
              "tokens/s": round(report[key]["tokens_per_s"], 1),
              "speedup vs no speculation": round(report["speedup_vs_baseline"].get(key, 1.0), 3),
              "outputs identical": report["outputs_identical_by_run"].get(key, True)}
             for name, key in (("no speculation", "baseline"), ("EAGLE-3, trained", "online"),
                               ("EAGLE-3, untrained", "untrained"), ("n-gram", "ngram"))]
    display(pl.DataFrame(speed))
    print(f"speedup of the trained drafter: {report['speedup_vs_baseline']['online']:.2f}x; "
          f"outputs identical with and without speculation: {report['outputs_identical']}")
    """),
    md(r"""
    ## Train/serve check

    `check.json` (`eagle-ray check`): the exported drafter loaded in vLLM is fed the features
    it was trained on. vLLM's V1 and V2 model runners resolve the same aux layer ids as the
    store's, and the features vLLM hands the drafter for a store sample equal the stored ones
    within the tolerance (per layer).
    """),
    code(r"""
    check = json.loads((RUN / "check.json").read_text())
    print(f"check ok: {check['ok']}; max |diff| {check['max_abs_diff']:.3g} (tolerance {check['tolerance']:.3g}) "
          f"over {check['tokens_compared']} tokens, proposer {check.get('proposer')}")
    print("per layer:", {k: f"{v:.3g}" for k, v in check.get("max_abs_diff_per_layer", {}).items()})
    print("aux layer ids each vLLM runner serves:", check.get("runner_layer_ids"))
    """),
    code(r"""
    Markdown((RUN / "evaluate" / "report.md").read_text())
    """),
]


NOTEBOOKS = {"01_data_and_plan.ipynb": NB01, "02_operate.ipynb": NB02, "03_results.ipynb": NB03}


def render(name: str) -> str:
    """The notebook file's exact text."""
    nb = new_notebook(cells=[c.copy() for c in NOTEBOOKS[name]], metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
        "language_info": {"name": "python"}})
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{name[:2]}-{i:02d}"  # fixed ids: nbformat would draw random ones
    nbformat.validate(nb)
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for name in NOTEBOOKS:
        path = HERE / name
        text = render(name)
        if check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"not as notebooks/build.py generates them: {', '.join(stale)} "
              "(run `.venv/bin/python notebooks/build.py`)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
