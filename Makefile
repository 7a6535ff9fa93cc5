.PHONY: setup demo test bench
# Ray's anonymous usage stats stay off; vLLM must not reach for a model hub.
export RAY_USAGE_STATS_ENABLED=0
export HF_HUB_OFFLINE=1

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python -m eagle_ray.job.demo --out out/demo

# CI passes PYTEST_ARGS="-v --durations=30": each test named as it ends, the slowest listed.
PYTEST_ARGS ?= -q
test: setup
	.venv/bin/python -m pytest $(PYTEST_ARGS) -n 2 --dist loadfile tests

bench: setup
	.venv/bin/python bench/bench_ingest_stats.py
