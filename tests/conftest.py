import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def tiny_target_dir():
    """The cached tiny target (built once per machine, ~30 s on 2 cores)."""
    from eagle_ray.targets.tiny.target import ensure_tiny_target

    return ensure_tiny_target()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_target_dir))
