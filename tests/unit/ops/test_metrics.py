"""The metric catalogue, the Grafana dashboard built on it, and recording outside Ray."""

import json
import re
from pathlib import Path

from eagle_ray.job import launch
from eagle_ray.ops.metrics import METRICS, record

DASHBOARD = Path(__file__).resolve().parents[3] / "grafana" / "eagle_ray_dashboard.json"


def _exported(name: str) -> str:
    """The name Ray's Prometheus endpoint shows for one of our metrics."""
    return f"ray_{name}_total" if METRICS[name][0] == "counter" else f"ray_{name}"


def test_grafana_panels_cover_every_metric_and_name_only_real_ones():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = set(re.findall(r"\b(ray_eagle_ray_\w+)", " ".join(exprs)))
    exported = {_exported(n) for n in METRICS}
    assert used <= exported, used - exported
    assert exported <= used, f"metrics without a panel: {exported - used}"
    # Every eagle_ray panel filters by the job variable; the job variable lists real jobs.
    for e in exprs:
        if "eagle_ray_" in e:
            assert 'job=~"$job"' in e, e
    job_var = next(v for v in dash["templating"]["list"] if v["name"] == "job")
    assert re.search(r"label_values\((ray_eagle_ray_\w+), job\)", job_var["query"]).group(1) in exported


def test_every_metric_is_tagged_by_job_and_stage():
    for name, (kind, desc, tags) in METRICS.items():
        assert kind in ("counter", "gauge") and desc and tags[0] == "stage", name


def test_record_outside_ray_is_a_no_op():
    """In a fresh interpreter (a test session may have Ray running): recording neither starts
    Ray nor raises, for a known or an unknown metric."""
    import subprocess
    import sys

    code = ("import ray; from eagle_ray.ops.metrics import record; "
            "record('eagle_ray_samples_committed', 3, stage='extract'); "
            "record('eagle_ray_no_such_metric', 1); print(ray.is_initialized())")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "False"


def test_job_metadata_from_the_entrypoint():
    args = launch.job_args("/tmp/x", recipe="tiny_kimi_cpu", sets=["train.max_steps=4", "a.b=1"])
    meta = launch.job_metadata(args)
    assert meta == {"app": "eagle_ray", "recipe": "tiny_kimi_cpu", "out": "/tmp/x",
                    "set": "train.max_steps=4 a.b=1"}


def test_dashboard_file_is_what_the_script_writes():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "grafana_dashboard", DASHBOARD.parents[1] / "scripts" / "grafana_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert json.loads(DASHBOARD.read_text()) == mod.build()
