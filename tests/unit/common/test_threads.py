"""A `ray job submit` driver's torch gets the CPUs it may run on, not Ray's one thread."""

import json
import os

import pytest

from eagle_ray.common.threads import JOB_CONFIG_ENV, driver_threads

CPUS = len(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(CPUS < 2, reason="one CPU: nothing to give the driver")


def job_env(omp: str = "1", runtime_env_vars: dict | None = None) -> dict:
    return {JOB_CONFIG_ENV: json.dumps({"runtime_env": {"env_vars": runtime_env_vars or {}},
                                        "metadata": {}}),
            "OMP_NUM_THREADS": omp}


def test_a_job_driver_left_one_thread_by_ray_takes_its_cpus():
    assert driver_threads(job_env()) == CPUS


@pytest.mark.parametrize("env", [
    {"OMP_NUM_THREADS": "1"},                            # not a Ray job's driver
    job_env(runtime_env_vars={"OMP_NUM_THREADS": "1"}),  # the user asked for one thread
    job_env(omp="3"),                                    # a count Ray did not default
    {JOB_CONFIG_ENV: "not json", "OMP_NUM_THREADS": "1"},
], ids=["outside-a-job", "users-runtime-env", "not-rays-default", "unreadable-job-config"])
def test_a_users_choice_and_other_processes_stand(env):
    assert driver_threads(env) is None
