"""Connecting to Ray without hanging on a cluster that is gone.

`ray.init()` with no address connects to RAY_ADDRESS or, failing that, to the cluster
recorded by the last `ray start` on this machine (RAY_TMPDIR/ray_current_cluster). If that
head has died, ray.init retries "Failed to connect to GCS" for 10+ minutes. `init_ray`
first checks that the address answers (a TCP connect, bounded by
EAGLE_RAY_CONNECT_TIMEOUT_S, default 10 s) and otherwise fails at once, naming where the
address came from and how to get rid of it.
"""

from __future__ import annotations

import logging
import os
import socket

from eagle_ray.common import logs

logger = logging.getLogger(__name__)


class RayConnectError(ConnectionError):
    """The Ray cluster this process would connect to does not answer."""


def resolve_address(address: str | None) -> tuple[str | None, str]:
    """(host:port or None to start a local Ray, where the address came from)."""
    env = os.environ.get("RAY_ADDRESS")
    if env:
        address, source = env, "RAY_ADDRESS"
    elif address:
        source = "the address given"
    else:
        from ray._private.utils import read_ray_address

        address = read_ray_address(None)
        source = "the cluster record of the last `ray start` on this machine"
    if address in (None, "", "local"):
        return None, source
    if address == "auto" or address.startswith(("ray://", "http://", "https://")):
        return None, source  # Ray Client / auto-detection: leave to ray.init
    return address, source


def _record_path() -> str:
    from ray._common.utils import get_ray_address_file

    return get_ray_address_file(None)


def check_reachable(address: str, source: str, timeout_s: float) -> None:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as e:
        reason = f"{type(e).__name__}: {e}"
    if source == "RAY_ADDRESS":
        fix = ("start that cluster, point RAY_ADDRESS at a live head, or unset RAY_ADDRESS to "
               "start a local Ray")
    elif source.startswith("the cluster record"):
        fix = (f"the head recorded in {_record_path()} is gone (a stale cluster record): delete that "
               "file to start a local Ray, or set RAY_ADDRESS to a live head")
    else:
        fix = "start that cluster or pass a live address"
    raise RayConnectError(f"Ray cluster at {address} (from {source}) does not answer within "
                          f"{timeout_s:g} s ({reason}); {fix}")


def init_ray(address: str | None = None, **kwargs) -> None:
    """ray.init unless already connected; fails in bounded time on a dead address."""
    import ray

    if ray.is_initialized():
        return
    resolved, source = resolve_address(address)
    if resolved is not None:
        timeout_s = float(os.environ.get("EAGLE_RAY_CONNECT_TIMEOUT_S", "10"))
        check_reachable(resolved, source, timeout_s)
        logger.info("connecting to Ray at %s (from %s)", resolved, source)
    kwargs.setdefault("logging_level", logs.ray_logging_level())
    kwargs["runtime_env"] = _with_logging(kwargs.get("runtime_env"))
    ray.init(address=resolved if resolved is not None else address, **kwargs)
    from eagle_ray.common import signals

    if os.environ.get(signals.INSTALLED_ENV) == str(os.getpid()):
        signals.install()  # again: Ray's core worker replaced our SIGTERM handler with an abort


def _with_logging(runtime_env: dict | None) -> dict:
    """The run's logging settings for every worker (eagle_ray/common/logs.py): its env vars
    and Ray's worker_process_setup_hook, except what the job's own runtime env already sets
    (Ray refuses a driver runtime env that repeats a key of the job's)."""
    import json

    env = dict((runtime_env or {}).get("env_vars", {}))
    job = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}") or "{}").get("runtime_env") or {}
    taken = set((job.get("env_vars") or {}))
    env.update({k: v for k, v in logs.worker_env().items() if k not in taken and k not in env})
    out = dict(runtime_env or {})
    if env:
        out["env_vars"] = env
    if "worker_process_setup_hook" not in job and "worker_process_setup_hook" not in out:
        out["worker_process_setup_hook"] = "eagle_ray.common.logs.setup_worker"
    return out
