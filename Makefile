.PHONY: setup demo demo-real test test-all test-fast lint bench
# Ray's anonymous usage stats stay off; vLLM must not reach for a model hub.
export RAY_USAGE_STATS_ENABLED=0
export HF_HUB_OFFLINE=1

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/python -m eagle_ray.job.demo --out out/demo

# The real target end to end on 2 cores in under 30 minutes (README, "The real target"):
# SmolLM2-135M-Instruct (recipe smollm2_cpu, its defaults) on 300 ShareGPT conversations, 100
# training steps, 8 held-out prompts greedy and 1 seed as served; prints one trained-on sample
# as text and the acceptance report. bench/real_target.py is the benchmark at a real budget.
demo-real: setup
	.venv/bin/python -m eagle_ray.job.demo --recipe smollm2_cpu --sharegpt 300 --out out/demo-real \
		--set train.max_steps=100 --set evaluate.prompts=8 --set evaluate.seeds=1

# CI passes PYTEST_ARGS="-v --durations=30": each test named as it ends, the slowest listed.
# One test at a time: each integration test already keeps both cores busy (vLLM, Ray
# workers); two files side by side thrashed (the same suite took 64 min with -n 2, 42 serial),
# and one session shares its built pipelines across files.
PYTEST_ARGS ?= -q
# CI's suite: everything but the long scenario runs (pytest marker `long`; README, Tests).
test: lint
	.venv/bin/python -m pytest $(PYTEST_ARGS) -m "not long" tests

# Everything, the long scenario runs included (~90 min on 2 cores): before a release, and after
# a change to what a long test alone covers (README, Tests).
test-all: lint
	.venv/bin/python -m pytest $(PYTEST_ARGS) tests

# pyproject.toml [tool.ruff]: no private member of another object, a complexity ceiling.
lint: setup
	.venv/bin/ruff check eagle_ray

# The inner loop: tests/unit (no Ray cluster, no vLLM engine in this process; a few start a
# short subprocess). Which change needs the full suite: README, "Tests".
test-fast: setup
	.venv/bin/python -m pytest $(PYTEST_ARGS) tests/unit

bench: setup
	.venv/bin/python bench/bench_ingest_stats.py
