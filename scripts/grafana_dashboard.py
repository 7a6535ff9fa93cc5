"""Write grafana/eagle_ray_dashboard.json: the eagle_ray panels for clusters that run Grafana
over Ray's Prometheus metrics (import it, pick the Prometheus data source). The metric names
are those of eagle_ray/ops/metrics.py (tests/unit/test_metrics.py checks every one has a panel).

    .venv/bin/python scripts/grafana_dashboard.py
"""

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "grafana" / "eagle_ray_dashboard.json"
J = 'job=~"$job"'
PANELS = [
    ("Generation: prompts/s by status", "reqps",
     [(f'sum by (status) (rate(ray_eagle_ray_prompts_generated_total{{{J}}}[1m]))', "{{status}}")]),
    ("Generation: completion tokens/s", "short",
     [(f'sum(rate(ray_eagle_ray_completion_tokens_total{{{J}}}[1m]))', "tokens/s")]),
    ("Extraction: samples committed/s", "short",
     [(f'sum(rate(ray_eagle_ray_samples_committed_total{{{J}}}[1m]))', "samples/s")]),
    ("Extraction: feature bytes committed/s", "Bps",
     [(f'sum(rate(ray_eagle_ray_bytes_committed_total{{{J}}}[1m]))', "bytes/s")]),
    ("Committed so far (samples, tokens)", "short",
     [(f'sum(ray_eagle_ray_samples_committed_total{{{J}}})', "samples"),
      (f'sum(ray_eagle_ray_tokens_committed_total{{{J}}})', "tokens")]),
    ("Rejects by stage and reason", "short",
     [(f'sum by (stage, reason) (ray_eagle_ray_rejects_total{{{J}}})', "{{stage}} {{reason}}")]),
    ("Batches in flight per pool", "short",
     [(f'sum by (stage) (ray_eagle_ray_batches_in_flight{{{J}}})', "{{stage}}")]),
    ("Replicas per pool (alive, bounds, desired)", "short",
     [(f'max by (stage) (ray_eagle_ray_replicas{{{J}}})', "{{stage}} alive"),
      (f'max by (stage, bound) (ray_eagle_ray_pool_bound{{{J}}})', "{{stage}} {{bound}}")]),
    ("Training loss and step", "short",
     [(f'max(ray_eagle_ray_train_loss{{{J}}})', "loss"),
      (f'max(ray_eagle_ray_train_step{{{J}}})', "step")]),
    ("Training accuracy per TTT step", "percentunit",
     [(f'max by (stage, ttt_step) (ray_eagle_ray_train_accuracy{{{J}}})', "{{stage}} step {{ttt_step}}")]),
    ("Training tokens/s", "short", [(f'max(ray_eagle_ray_train_tokens_per_s{{{J}}})', "tokens/s")]),
    ("Training data-wait fraction", "percentunit",
     [(f'max(ray_eagle_ray_train_data_wait_fraction{{{J}}})', "data wait")]),
    ("Evaluation: mean acceptance length", "short",
     [(f'max by (run) (ray_eagle_ray_acceptance_length{{{J}}})', "{{run}}")]),
    ("vLLM: running / waiting requests", "short",
     [("sum(ray_vllm_num_requests_running)", "running"), ("sum(ray_vllm_num_requests_waiting)", "waiting")]),
    ("vLLM: KV cache usage", "percentunit", [("max(ray_vllm_kv_cache_usage_perc)", "usage")]),
    ("vLLM: generation tokens/s", "short",
     [("sum(rate(ray_vllm_generation_tokens_total[1m]))", "tokens/s")]),
]


def build() -> dict:
    ds = {"type": "prometheus", "uid": "${datasource}"}
    panels = [{"id": i + 1, "title": title, "type": "timeseries", "datasource": ds,
               "gridPos": {"x": (i % 2) * 12, "y": (i // 2) * 8, "w": 12, "h": 8},
               "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
               "targets": [{"refId": chr(65 + j), "expr": e, "legendFormat": legend}
                           for j, (e, legend) in enumerate(targets)]}
              for i, (title, unit, targets) in enumerate(PANELS)]
    return {
        "title": "eagle_ray", "uid": "eagle-ray", "schemaVersion": 39, "version": 1,
        "editable": True, "tags": ["eagle_ray", "ray"],
        "description": "eagle_ray pipeline metrics (ray.util.metrics, exported by each Ray "
                       "node's metrics agent) and vLLM engine metrics (its Ray stat logger). "
                       "Written by scripts/grafana_dashboard.py.",
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "current": {}},
            {"name": "job", "type": "query", "datasource": ds, "refresh": 2,
             "query": "label_values(ray_eagle_ray_samples_committed_total, job)",
             "includeAll": True, "multi": True, "current": {"text": "All", "value": "$__all"}},
        ]},
        "panels": panels,
    }


if __name__ == "__main__":
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {OUT}")
