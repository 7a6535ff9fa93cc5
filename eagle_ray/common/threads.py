"""The CPU threads of a `ray job submit` driver.

Ray runs a job's entrypoint as a child process of its job supervisor, an actor that asks for
no CPU (`entrypoint_num_cpus` 0, the default). Ray sets OMP_NUM_THREADS in a worker that has
none (`ray._private.utils.set_omp_num_threads_if_unset`), to 1 for an actor of no CPUs, and
the entrypoint inherits it. So the job driver's own torch work, evaluate's offline acceptance
above all, ran on one core: on 2 cores with SmolLM2 (`make demo-real`'s store, 37 held-out
samples) that step took 204-221 s on one thread and 123 s on two. The driver's steps run one
after another, never beside a stage's actors, so its torch takes the CPUs it may run on.

Only this process's torch: the environment stays as Ray set it, so the processes the driver
starts keep one thread. vLLM serves on one torch thread unless OMP_NUM_THREADS says more, and
warns on the console when it does ("Multi-threaded torch CPU ops during serving can degrade
performance").
"""

from __future__ import annotations

import json
import logging
import os
from typing import Mapping

logger = logging.getLogger(__name__)

# Set by Ray's job supervisor in the entrypoint's environment: the job's config (runtime_env).
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def driver_threads(environ: Mapping[str, str]) -> int | None:
    """The torch threads a Ray job's driver should take: the CPUs this process may run on,
    when its OMP_NUM_THREADS=1 is Ray's default (the job's runtime_env names none); else None.

    A user's own choice stands: an OMP_NUM_THREADS in the job's runtime_env, or any value but
    Ray's 1. (`entrypoint_num_cpus=1` also gives 1, which this takes for Ray's default.)
    """
    config = environ.get(JOB_CONFIG_ENV)
    if config is None or environ.get("OMP_NUM_THREADS") != "1":
        return None
    try:
        runtime_env = json.loads(config).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    if "OMP_NUM_THREADS" in (runtime_env.get("env_vars") or {}):
        return None
    n = len(os.sched_getaffinity(0))  # Linux, as Ray's and vLLM's CPU builds
    return n if n > 1 else None


def take_driver_threads() -> int | None:
    """Give this job driver's torch `driver_threads` (the count set, or None)."""
    n = driver_threads(os.environ)
    if n is not None:
        import torch

        torch.set_num_threads(n)
        logger.info("job driver: torch on %d CPU threads (Ray's job supervisor had set "
                    "OMP_NUM_THREADS=1)", n)
    return n
