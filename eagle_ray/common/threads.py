"""The CPU threads of a `ray job submit` driver.

Ray runs a job's entrypoint as a child process of its job supervisor, an actor that asks for
no CPU (`entrypoint_num_cpus` 0, the default). Ray sets OMP_NUM_THREADS in a worker that has
none (`ray._private.utils.set_omp_num_threads_if_unset`), to 1 for an actor of no CPUs, and
the entrypoint inherits it. So the job driver's own torch work (evaluate's offline
acceptance) and the processes it starts (evaluate's isolated vLLM engine, which runs its model
in-process) ran on one core of the machine: on 2 cores `make demo-real`'s evaluate step took
824 s (README, "The real target"). The driver's steps run one after another, never beside a
stage's actors, so the driver takes the CPUs it may run on.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import MutableMapping

logger = logging.getLogger(__name__)

# Set by Ray's job supervisor in the entrypoint's environment: the job's config (runtime_env).
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def job_driver_threads(environ: MutableMapping[str, str] | None = None) -> int | None:
    """In a Ray job's driver whose OMP_NUM_THREADS=1 is Ray's default (the job's runtime_env
    names none), set OMP_NUM_THREADS (for the processes it starts) and torch's threads (if
    torch is loaded) to the CPUs this process may run on; the count set, else None.

    A user's own choice stands: an OMP_NUM_THREADS in the job's runtime_env, or any value but
    Ray's 1. (`entrypoint_num_cpus=1` also gives 1, which this takes for Ray's default.)
    """
    env = os.environ if environ is None else environ
    config = env.get(JOB_CONFIG_ENV)
    if config is None or env.get("OMP_NUM_THREADS") != "1":
        return None
    try:
        runtime_env = json.loads(config).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    if "OMP_NUM_THREADS" in (runtime_env.get("env_vars") or {}):
        return None
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if n <= 1:
        return None
    env["OMP_NUM_THREADS"] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    logger.info("job driver: %d CPU threads (Ray's job supervisor had set OMP_NUM_THREADS=1)", n)
    return n
