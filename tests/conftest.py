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


# Test files run side by side on CI's two cores (`pytest -n 2 --dist loadgroup`, the README's
# test command): each file is one group, so its module fixtures (a trained run, a generation,
# a Ray head) are built once, on one worker. Notebook 03 reads the session's finished run,
# so it runs with the file that builds it.
_GROUP_OF = {"tests/integration/test_notebooks.py::test_03_results": "test_kimi_pipeline"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _GROUP_OF.get(item.nodeid.split("[")[0], item.path.stem)
        item.add_marker(pytest.mark.xdist_group(group))
