"""Submitting the end-to-end job with `ray job submit`, to a local head this module starts or
to the cluster RAY_ADDRESS names (used by `make demo` and by tests/integration/test_job.py).

Why the job runs in the project's environment: a job's entrypoint runs in the cluster's
environment, not the submitting shell's, so a bare `python` there may be the system Python
(`No module named 'pyarrow'`). The entrypoint therefore names this environment's interpreter
(`sys.executable`), and a head started here runs from this environment too (its workers use
the interpreter that ran `ray start`). On a remote cluster the project must be installed at
the same path on its nodes.

A local head gets its own temp dir and ports and is started in a new session, so all of its
daemons share one process group: `LocalHead.stop` ends exactly that group, never another Ray
on the machine (no `ray stop`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from eagle_ray.common.logs import SUBMITTED_FROM_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
# What the job does not need from the working tree (the venv alone is GBs).
EXCLUDES = [".venv", "out", ".git", "*.egg-info", "__pycache__", ".pytest_cache", "build"]


def auth_env() -> dict[str, str]:
    """The token-authentication mode for a head this module starts and for the job commands
    it runs, made consistent: Ray 2.60 enables token authentication on a head whenever
    ~/.ray/auth_token exists (a local `ray.init` creates one), while its job client stays in
    'disabled' mode unless told otherwise and is then refused ("Missing authentication
    token"). RAY_AUTH_MODE, when set, wins."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode:
        return {"RAY_AUTH_MODE": mode}
    return {"RAY_AUTH_MODE": "token"} if (Path.home() / ".ray" / "auth_token").exists() else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalHead:
    temp_dir: Path
    pgid: int
    gcs_address: str
    dashboard_url: str
    metrics_url: str  # the head node's Prometheus endpoint (Ray's and eagle_ray's metrics)

    def stop(self, timeout_s: float = 15.0) -> None:
        """End every process of this head (its process group): TERM, then KILL."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                return
            deadline = time.time() + timeout_s
            while time.time() < deadline:
                try:
                    os.killpg(self.pgid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.2)


def start_head(*, num_cpus: int | None = None, object_store_bytes: int | None = None,
               dashboard_port: int | None = None, env: dict | None = None,
               temp_dir: str | Path | None = None) -> LocalHead:
    """`ray start --head` from this environment, dashboard on 127.0.0.1, every fixed port
    chosen free so it never collides with another Ray on the machine."""
    td = Path(temp_dir or tempfile.mkdtemp(prefix="er-ray-", dir="/tmp"))  # short: socket paths
    td.mkdir(parents=True, exist_ok=True)
    port, dash, metrics = free_port(), dashboard_port or free_port(), free_port()
    cmd = [RAY, "start", "--head", f"--temp-dir={td}", f"--port={port}",
           f"--metrics-export-port={metrics}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--ray-client-server-port={free_port()}",
           f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats"]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    if object_store_bytes is not None:
        cmd.append(f"--object-store-memory={object_store_bytes}")
    proc = subprocess.Popen(cmd, env={**os.environ, **auth_env(), **(env or {})}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    head = LocalHead(temp_dir=td, pgid=proc.pid, gcs_address=f"127.0.0.1:{port}",
                     dashboard_url=f"http://127.0.0.1:{dash}",
                     metrics_url=f"http://127.0.0.1:{metrics}/metrics")
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        head.stop()
        raise RuntimeError(f"`ray start --head` did not finish within 120 s (temp dir {td})")
    if proc.returncode != 0:
        head.stop()
        raise RuntimeError(f"`ray start --head` failed ({proc.returncode}):\n{output[-3000:]}")
    return head


def runtime_env(env_vars: dict | None = None) -> dict:
    return {"excludes": EXCLUDES,
            "env_vars": {"HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0",
                         "TOKENIZERS_PARALLELISM": "false", **(env_vars or {})}}


def job_args(out_dir: str | Path, *, recipe: str = "tiny_cpu", sets: list[str] = (),
             data: list[str] = (), online: bool = False) -> list[str]:
    """The job's entrypoint: this environment's interpreter running jobs/end_to_end.py."""
    args = [sys.executable, "-m", "jobs.end_to_end", "--recipe", recipe,
            "--out", str(Path(out_dir).resolve())]
    for s in sets:
        args += ["--set", s]
    for d in data:
        args += ["--data", d]
    if online:
        args.append("--online")
    return args


def ray_job(args: list[str], address: str | None, **kw) -> subprocess.CompletedProcess:
    """Run `ray job ARGS` (the CLI users run) against address (or RAY_ADDRESS)."""
    addr = ["--address", address] if address else []
    return subprocess.run([RAY, "job", args[0], *addr, *args[1:]], cwd=REPO_ROOT, **kw)


def job_metadata(entrypoint: list[str]) -> dict[str, str]:
    """What the dashboard's Jobs page shows with the job: the recipe, the output directory and
    the --set overrides, read from the entrypoint's arguments."""
    meta = {"app": "eagle_ray"}
    for flag, key in (("--recipe", "recipe"), ("--out", "out")):
        if flag in entrypoint[:-1]:
            meta[key] = entrypoint[entrypoint.index(flag) + 1]
    sets = [entrypoint[i + 1] for i, a in enumerate(entrypoint[:-1]) if a == "--set"]
    if sets:
        meta["set"] = " ".join(sets)
    return meta


def submit(entrypoint: list[str], address: str | None, submission_id: str,
           env_vars: dict | None = None) -> None:
    p = ray_job(["submit", "--no-wait", "--submission-id", submission_id,
                 "--metadata-json", json.dumps(job_metadata(entrypoint)),
                 "--working-dir", str(REPO_ROOT),
                 "--runtime-env-json",
                 json.dumps(runtime_env({SUBMITTED_FROM_ENV: str(REPO_ROOT), **(env_vars or {})})),
                 "--", *entrypoint],
                address, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"`ray job submit` failed ({p.returncode}): {p.stdout[-2000:]}{p.stderr[-2000:]}")


def wait(address: str | None, submission_id: str, timeout_s: float = 3600) -> str:
    """Poll until the job ends; its final status name (SUCCEEDED, FAILED, STOPPED)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(address)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        st = client.get_job_status(submission_id)
        if st in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            return st.value
        time.sleep(1)
    raise TimeoutError(f"job {submission_id} still running after {timeout_s:.0f} s")
