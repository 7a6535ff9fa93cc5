import os

import pytest

# Fail fast instead of hanging (PLATFORM.md): Ray Data stalls raise, Train fails once.
os.environ.setdefault("RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S", "300")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the session: 4 logical CPUs on 2 cores so actor stages don't starve
    the read tasks; no dashboard (faster start). Yields the GCS address for subprocess drivers."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=512 << 20,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def logged_store(d, n: int, seed: int, recipe):
    """Corpus conversations -> ingest -> keep_logged conversations -> store under d (prompts/,
    conv/, store/): a real store of the tiny target without spending time on generation."""
    import json

    from eagle_ray.data.ingest import SourceSpec, ingest
    from eagle_ray.extract.run import run_extract
    from eagle_ray.generate.run import run_generate
    from eagle_ray.targets.tiny import corpus

    lines = [json.dumps({"messages": c}) for c in corpus.conversations(n, seed=seed)]
    (d / "in.jsonl").write_text("\n".join(lines) + "\n")
    ingest([SourceSpec.parse(str(d / "in.jsonl"))], d / "prompts")
    run_generate(recipe, d / "prompts", d / "conv")
    run_extract(recipe, d / "conv", d / "store")
    return d / "store"


@pytest.fixture(scope="session")
def make_logged_store():
    return logged_store


@pytest.fixture(scope="session")
def tiny_trained(tmp_path_factory, ray_cluster, tiny_target_dir):
    """400 logged conversations of the tiny target -> store -> a TINY_STEPS training run ->
    its export, built once per session: (directory holding in.jsonl, prompts/, conv/, store/,
    run/ and drafter/, recipe). test_train.py checks what the run learned; test_export_evaluate.py
    exports, checks, serves and evaluates it. Readers only: a test that writes works in its
    own tmp_path."""
    from eagle_ray.export.drafter import export_drafter
    from eagle_ray.recipes import load_recipe
    from eagle_ray.train.run import run_train
    from sample_data import TINY_STEPS, TINY_TRAINED

    d = tmp_path_factory.mktemp("tiny_trained")
    r = load_recipe("tiny_cpu", TINY_TRAINED + [f"train.max_steps={TINY_STEPS}",
                                                f"train.eval_interval={TINY_STEPS}"])
    logged_store(d, 400, 33, r)
    run_train(r, d / "store", d / "run")
    export_drafter(d / "run", d / "drafter")
    return d, r


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, ray_cluster):
    """The whole pipeline once per session on the Kimi-K2.5 twin (`tiny_kimi_cpu`: the
    production Kimi recipe with tiny numbers and CPU engine arguments), on the sample data:
    (run directory, summary). test_kimi_pipeline.py checks it; test_notebooks.py reads it
    with notebooks/03_results.py."""
    from eagle_ray.recipes import load_recipe
    from eagle_ray.job.pipeline import run_end_to_end

    # 100 steps (a quality floor: online beats n-gram by 1.0): 150 steps gave online
    # acceptance 4.83 (n-gram 1.79); 60 steps gave 2.69, short of the floor.
    r = load_recipe("tiny_kimi_cpu", ["train.max_steps=100", "train.eval_interval=100",
                                      "train.ckpt_interval=100", "train.cpus_per_worker=1",
                                      "evaluate.seeds=1", "evaluate.prompts=24"])
    run = tmp_path_factory.mktemp("kimi_twin") / "run"
    from sample_data import small_sample_data

    return run, run_end_to_end(r, small_sample_data(), run)



@pytest.fixture(scope="session")
def finished_curve(finished_run):
    """`eagle-ray curve` on the finished run (3 nested fractions, 20 steps each, the largest
    also online as served on 8 prompts), written to RUN/curve where notebook 03 finds it."""
    from eagle_ray.evaluate.curve import run_curve
    from eagle_ray.recipes import load_recipe

    run, _ = finished_run
    # 8 steps a fraction: the curve's mechanics (nesting, split, fit, plot), not its slope.
    r = load_recipe("tiny_kimi_cpu", ["train.cpus_per_worker=1", "curve.fractions=0.25,0.5,1",
                                      "curve.steps=8", "curve.online_prompts=8"])
    return run / "curve", run_curve(r, run / "train", run / "curve", prompts=run / "ingest")


def train_killed_at(args: list[str], run, step: int, ray_address: str, last: int) -> None:
    """Run `eagle-ray train ARGS --out RUN` in its own process group and SIGKILL it once the
    checkpoint of `step` exists (before `last`'s): a crash mid-training."""
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "eagle_ray.cli", "train", *args, "--out", str(run)],
                            env={**os.environ, "RAY_ADDRESS": ray_address},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (run / "checkpoints" / f"step-{step:07d}").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert f"step-{last:07d}" not in {p.name for p in (run / "checkpoints").glob("step-*")}, \
        "the kill should land mid-run"
    time.sleep(2)  # let Ray reap the dead driver's workers (and actors) before the next run


@pytest.fixture(scope="session")
def kill_training():
    return train_killed_at

