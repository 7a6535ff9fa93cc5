# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 2. Operating a running job
#
# Watch and steer an end-to-end job while it runs: its status and metadata, the tail of its
# log, the stage it is in, its rates on the Prometheus endpoint, and the size of its
# extraction pool, which we change while it runs (`eagle-ray scale extract N` does the
# same from a shell).
#
# With no `RAY_ADDRESS`, the notebook starts its own local Ray head (own temp dir, free
# ports, dashboard on 127.0.0.1), submits the end-to-end job on the tiny CPU target with
# `ray job submit` (2,400 logged conversations, one per extraction batch, so extraction
# lasts about a minute on 2 cores), and stops that head in the last cell (or when the kernel
# exits, whatever happened in between).
#
# | environment variable | default | meaning |
# |---|---|---|
# | `RAY_ADDRESS` | unset: start a local head | GCS address of a running cluster (`HEAD_IP:6379`, or `auto` on one of its nodes), as `eagle-ray scale --address` takes it |
# | `EAGLE_RAY_NB_JOB` | unset: submit the demo job | submission id of the eagle_ray job to operate |
# | `EAGLE_RAY_NB_OUT` | a new temporary directory | where a job this notebook submits writes (on a cluster: shared storage) |
# | `EAGLE_RAY_NB_CONVERSATIONS` | `2400` | conversations that job extracts |
# | `EAGLE_RAY_NB_STOP_JOB` | `1` if the notebook submitted the job, else `0` | stop the job at the end |
#
# **Dashboard.** The first cell prints the Ray dashboard's address: the Jobs page shows this
# job with its recipe and output directory, Metrics the `eagle_ray_*` panels
# (`grafana/eagle_ray_dashboard.json`), Train the training run. On a cluster launched
# with `cluster.yaml`, `.venv/bin/ray dashboard cluster.yaml` tunnels the loopback-only
# dashboard to http://127.0.0.1:8265; run this notebook on the head node (with
# `RAY_ADDRESS=auto`) so that it can join the cluster as a driver.

# %%
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

from eagle_ray.job import launch

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

# %% [markdown]
# ## Submit the job
#
# Skipped when `EAGLE_RAY_NB_JOB` names a running job. The entrypoint is this environment's
# interpreter running `jobs/end_to_end.py` (`launch.job_args`), the working directory is the
# repository (`launch.submit`, the `ray job submit` users run), and the submission metadata
# carries the recipe, output directory and `--set` overrides to the dashboard's Jobs page.

# %%
from eagle_ray.targets.tiny import corpus

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

# %% [markdown]
# ## Wait for extraction
#
# The driver ingests, then streams the conversations through the extraction pool; the first
# committed index part in `OUT/store/index` means the pool is running. `stage_of` reads the
# stage from the log: the pipeline prints one line per finished step (`ingest: accepted ...`,
# `generate+extract (...)`, `train: step ...`, `export + check: ...`, `evaluate: ...`,
# and the closing `summary` with its `wall time: ...` line; training's progress lines also
# start with `train: step`).

# %%
from ray.job_submission import JobStatus, JobSubmissionClient

from eagle_ray.store.reader import read_index

client = JobSubmissionClient(DASHBOARD)
RUN = Path(client.get_job_info(JOB).metadata["out"])
STEPS = [("ingest: accepted", "ingest"), ("generate+extract (", "generate+extract"),
         ("train: step", "train"), ("export + check:", "export + check"),
         ("evaluate: mean acceptance", "evaluate"), ("  wall time: ", "summary")]
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

# %% [markdown]
# ## Status, metadata, log, stage
#
# What `ray job status JOB` and the dashboard's Jobs page show, plus the last lines of the
# driver's log (`ray job logs JOB`).

# %%
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

# %% [markdown]
# ## Rates from the Prometheus endpoint
#
# Every `eagle_ray_*` metric is tagged with the Ray job id and the stage
# (`eagle_ray/ops/metrics.py`); Ray exports a metric `NAME` as `ray_NAME`, and a counter as
# `ray_NAME_total`. Two scrapes ten seconds apart give the counters' rates; gauges (replicas,
# batches in flight per replica, pool bounds) are shown as they are. Grafana and the
# dashboard's Metrics view read the same endpoint.

# %%
from eagle_ray.ops.metrics import METRICS

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

# %% [markdown]
# ## The pools, and scaling extraction while it runs
#
# `eagle_ray.ops.control.scale(stage, n, job)` is what `eagle-ray scale` calls: it sets the
# desired size on the job's control actor (`control:<job>`, namespace `eagle_ray`), and the
# job's Ray Data executor resizes the running pool between scheduling steps. Scaling up
# starts new replicas (the running one keeps its loaded model); scaling down drains the
# least busy replica: it takes no new batch, finishes and commits the ones it holds, then is
# released. Nothing is lost or extracted twice. With `wait_s` the call waits until the pool
# has the asked size. `scale(None, None, job)` only shows the pools.

# %%
from eagle_ray.ops.control import scale

pools = scale(None, None, JOB)

# %%
t0 = time.time()
scale("extract", 2, JOB, wait_s=90)
print(f"({time.time() - t0:.1f} s; {committed():,} samples committed)")

# %%
rates(5)

# %%
t0 = time.time()
scale("extract", 1, JOB, wait_s=90)
print(f"({time.time() - t0:.1f} s; {committed():,} samples committed)")

# %% [markdown]
# ## Stop the job
#
# `client.stop_job` (`ray job stop JOB`) ends the driver; the store keeps every committed
# sample, and submitting the same command again resumes where it stopped (finished steps
# are skipped, extraction skips committed samples). Skipped for a job this notebook did not
# submit unless `EAGLE_RAY_NB_STOP_JOB=1`.

# %%
if STOP_JOB:
    client.stop_job(JOB)
    final = launch.wait(DASHBOARD, JOB, 120)
    print(f"job {JOB}: {final}; {committed():,} of {accepted() or 0:,} samples committed in {RUN / 'store'}")
else:
    print(f"job {JOB} left running ({client.get_job_status(JOB).value})")

# %% [markdown]
# ## Clean up
#
# Disconnect from Ray and, only if this notebook started it, stop the local head (its
# process group: never `ray stop`, which would end every Ray on the machine).

# %%
ray.shutdown()
if head is not None:
    head.stop()
    atexit.unregister(head.stop)
    print(f"stopped the local Ray head (process group {head.pgid})")
