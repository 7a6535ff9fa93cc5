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

    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=512 << 20,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
