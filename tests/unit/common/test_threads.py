"""A `ray job submit` driver gets the CPUs it may run on, not Ray's one thread."""

import json
import os

import pytest

from eagle_ray.common.threads import JOB_CONFIG_ENV, job_driver_threads

CPUS = len(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(CPUS < 2, reason="one CPU: nothing to give the driver")


def job_env(omp: str | None = "1", runtime_env_vars: dict | None = None) -> dict:
    env = {JOB_CONFIG_ENV: json.dumps({"runtime_env": {"env_vars": runtime_env_vars or {}},
                                       "metadata": {}})}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    return env


def test_a_job_driver_left_one_thread_by_ray_takes_its_cpus():
    env = job_env()
    assert job_driver_threads(env) == CPUS
    assert env["OMP_NUM_THREADS"] == str(CPUS)  # and the processes it starts inherit them


@pytest.mark.parametrize("env", [
    {"OMP_NUM_THREADS": "1"},                            # not a Ray job's driver
    job_env(runtime_env_vars={"OMP_NUM_THREADS": "1"}),  # the user asked for one thread
    job_env(omp="3"),                                    # a count Ray did not default
], ids=["outside-a-job", "users-runtime-env", "not-rays-default"])
def test_a_users_choice_and_other_processes_stand(env):
    before = dict(env)
    assert job_driver_threads(env) is None
    assert env == before
