import os

import pytest

# Fail fast instead of hanging (PLATFORM.md): Ray Data stalls raise, Train fails once.
os.environ.setdefault("RAY_DATA_EXECUTION_NO_PROGRESS_TIMEOUT_S", "300")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


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
    from eagle_ray.tiny import corpus

    lines = [json.dumps({"messages": c}) for c in corpus.conversations(n, seed=seed)]
    (d / "in.jsonl").write_text("\n".join(lines) + "\n")
    ingest([SourceSpec.parse(str(d / "in.jsonl"))], d / "prompts")
    run_generate(recipe, d / "prompts", d / "conv")
    run_extract(recipe, d / "conv", d / "store")
    return d / "store"


@pytest.fixture(scope="session")
def make_logged_store():
    return logged_store
