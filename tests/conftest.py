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
def tiny_kimi_dir(tiny_target_dir):
    """The cached Kimi-K2.5 twin (built once per machine, ~1-2 min on 2 cores): built here,
    not inside a subprocess a test times."""
    from eagle_ray.targets.tiny.kimi import ensure_tiny_kimi

    return ensure_tiny_kimi()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_target_dir))


_spent: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Each test's wall time (setup, call and teardown together, so a session fixture's build
    is charged to the first test that asks for it) printed as the test ends (from 2 s up), and appended to
    $EAGLE_RAY_TEST_TIMES when set: a run cut short by CI's time limit still says where its
    time went (--durations prints only at the end)."""
    _spent[report.nodeid] = _spent.get(report.nodeid, 0.0) + report.duration
    if report.when != "teardown":
        return
    spent = _spent.pop(report.nodeid)
    line = f"{spent:8.1f}s {report.nodeid}"
    if spent >= 2:
        print(f"\n[time] {line}", end="")
    if os.environ.get("EAGLE_RAY_TEST_TIMES"):
        with open(os.environ["EAGLE_RAY_TEST_TIMES"], "a") as f:
            f.write(line + "\n")
