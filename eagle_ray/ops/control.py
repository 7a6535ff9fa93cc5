"""Live scaling of a running job's actor pools (`eagle-ray scale extract N`).

    eagle-ray scale ──▶ named control actor "control:<job>" (namespace eagle_ray; owned by the
                        job's driver, so it ends with the job) holding the desired sizes
                              ▲ polled about once a second, never blocking
    Ray Data's streaming executor ── PoolSizeController.on_execution_step (on the executor's
                        own thread, between scheduling steps) resizes the running pool

Why this way. Ray Data 2.60 has no public call that resizes a running actor pool: its
autoscaler reads the pool's bounds (`min_size`/`max_size`, from the pool's
`AutoscalingActorConfig`) on every scheduling step, but `ActorPoolStrategy` fixes them when the
dataset is built, and its scale-down only removes IDLE actors, which under a backlog never
happens. The one supported hook into a running execution is an `ExecutionCallback`
(registered through `DataContext.custom_execution_callback_classes`), called on the
executor's thread after every step, so changing the pool there cannot race the scheduler.
There we:

  scale up    raise the pool's min (and max) to N: the autoscaler starts the new replicas at
              its next step (a min above the current size bypasses its utilisation rule); the
              running replicas are untouched (no model reload);
  scale down  cancel replicas not started yet, then mark the least busy running ones as
              draining: they receive no new batch, finish the ones they hold (their shards
              commit as usual), and are released (Ray ends an actor with no reference left).

Nothing is lost or duplicated: a batch is either finished by its replica (committed) or never
handed to it. The internals used here (the operator's `_actor_pool`, its `_config`,
`_running_actors`, scheduling heaps, `_release_running_actor`, `_try_remove_pending_actor`, the
executor's `_topology`) are private to Ray Data 2.60, which requirements pin exactly;
`tests/unit/test_control.py` fails if they move. Any error in the controller disables it
(logged) rather than failing the job: the pool then keeps its recipe bounds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

from ray.data._internal.execution.execution_callback import ExecutionCallback

logger = logging.getLogger(__name__)

NAMESPACE = "eagle_ray"
PREFIX = "control:"
# Which Ray Data operators a stage name scales (operator names contain the UDF class name).
STAGE_OPERATORS = {"extract": ("ExtractUDF", "ColocatedUDF"),
                   "generate": ("GenerateUDF", "ColocatedUDF")}

_active: dict = {}  # job key -> this driver's control actor handle (set by start_control)


def job_key() -> str:
    """This driver's job as users name it: the submission id under `ray job submit`, else the
    Ray job id."""
    import ray

    try:
        meta = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("metadata", {})
        if meta.get("job_submission_id"):
            return meta["job_submission_id"]
    except ValueError:
        pass
    return ray.get_runtime_context().get_job_id()


def _actor_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class PoolControl:
        """Desired pool sizes (set by `eagle-ray scale`) and the pools' state (reported by the
        controller in the driver)."""

        def __init__(self):
            self.desired: dict[str, int] = {}
            self.state: dict[str, dict] = {}

        def set(self, stage: str, n: int) -> dict:
            self.desired[stage] = int(n)
            return dict(self.desired)

        def get_desired(self) -> dict:
            return dict(self.desired)

        def report(self, state: dict) -> None:
            self.state = state

        def status(self) -> dict:
            return {"desired": dict(self.desired), "pools": dict(self.state)}

    return PoolControl


def start_control():
    """The control actor of this driver's job (created once) and the executor callback that
    obeys it (registered in the current DataContext: call before building the datasets)."""
    import ray

    key = job_key()
    if key not in _active:  # one per job (a test process may see several Ray sessions)
        _active.clear()
        _active[key] = _actor_class().options(name=PREFIX + key, namespace=NAMESPACE,
                                              get_if_exists=True).remote()
        logger.info("live scaling: `eagle-ray scale extract N --job %s`", key)
    ctx = ray.data.DataContext.get_current()
    if PoolSizeController not in ctx.custom_execution_callback_classes:
        ctx.custom_execution_callback_classes.append(PoolSizeController)
    return _active[key]


def find_control(job: str | None):
    """The control actor of `job` (submission id or Ray job id), or of the only eagle_ray job
    running when job is None."""
    import ray

    if job is not None:
        try:
            return ray.get_actor(PREFIX + job, namespace=NAMESPACE)
        except ValueError:
            pass
    names = sorted(a["name"][len(PREFIX):] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == NAMESPACE and a["name"].startswith(PREFIX))
    if job is None and len(names) == 1:
        return ray.get_actor(PREFIX + names[0], namespace=NAMESPACE)
    running = ", ".join(names) or "none"
    raise ValueError(f"no running eagle_ray job {job!r} on this cluster (jobs that can be "
                     f"scaled: {running}); pass --job with one of them" if job else
                     f"{len(names)} eagle_ray jobs are running ({running}); pass --job")


class _Operator:
    """The Ray Data internals one resize touches, in one place."""

    def __init__(self, op):
        self.op, self.pool = op, op._actor_pool

    def running(self) -> dict:
        return self.pool._running_actors

    def stop_scheduling(self, actor) -> None:
        st = self.pool._running_actors[actor]
        self.pool._alive_actors_to_in_flight_tasks_heap.pop(actor, None)
        self.pool._alive_node_to_actor_heap.get(st.actor_location, {}).pop(actor, None)

    def in_flight(self, actor) -> int:
        return self.pool._running_actors[actor].num_tasks_in_flight

    def release(self, actor) -> None:
        self.pool._release_running_actor(actor)

    def cancel_pending(self) -> bool:
        return bool(self.pool._try_remove_pending_actor())

    def pending(self) -> int:
        return self.pool.num_pending_actors()

    def set_bounds(self, n: int, draining: int) -> None:
        cfg = self.pool._config
        new = dataclasses.replace(cfg, min_size=n, initial_size=n, max_size=n + draining)
        if new != cfg:
            self.pool._config = new

    def bounds(self) -> tuple[int, int]:
        return self.pool.min_size(), self.pool.max_size()


class PoolSizeController(ExecutionCallback):
    """Ray Data execution callback (see the module doc). Instantiated by Ray Data per execution
    with no arguments; finds the control actor through this module."""

    POLL_S = 1.0

    def before_execution_starts(self, executor) -> None:
        self.control = next(iter(_active.values()), None)
        self.desired: dict[str, int] = {}
        self.ref = None
        self.last = 0.0
        self.draining: dict[int, set] = {}
        self.disabled = self.control is None

    def on_execution_step(self, executor) -> None:
        if getattr(self, "disabled", True):
            return
        try:
            self._step(executor)
        except Exception:
            self.disabled = True
            logger.exception("live scaling disabled for this run (pools keep their recipe bounds)")

    def _step(self, executor) -> None:
        import ray
        from ray.data._internal.execution.operators.actor_pool_map_operator import (
                                                                                    ActorPoolMapOperator)

        now = time.time()
        if self.ref is None and now - self.last >= self.POLL_S:
            self.ref, self.last = self.control.get_desired.remote(), now
            poll = True
        else:
            poll = False
        if self.ref is not None and ray.wait([self.ref], timeout=0)[0]:
            self.desired, self.ref = ray.get(self.ref), None
        state = {}
        for op in executor._topology:
            if not isinstance(op, ActorPoolMapOperator):
                continue
            stages = [s for s, names in STAGE_OPERATORS.items() if any(n in op.name for n in names)]
            o = _Operator(op)
            n = next((self.desired[s] for s in stages if s in self.desired), None)
            if n is not None and not op.has_completed():
                self._resize(o, max(1, n))
            drain = self.draining.get(id(op), set())
            lo, hi = o.bounds()
            for s in stages:
                state[s] = {"operator": op.name, "running": len(o.running()) - len(drain),
                            "draining": len(drain), "pending": o.pending(), "min": lo,
                            "max": hi - len(drain), "desired": self.desired.get(s),
                            "completed": op.has_completed()}
        if poll and state:
            self.control.report.remote(state)
            from eagle_ray.ops.metrics import record

            for s, st in state.items():
                record("eagle_ray_replicas", st["running"], stage=s)
                record("eagle_ray_pool_bound", st["min"], stage=s, bound="min")
                record("eagle_ray_pool_bound", st["max"], stage=s, bound="max")
                if st["desired"] is not None:
                    record("eagle_ray_pool_bound", st["desired"], stage=s, bound="desired")

    def _resize(self, o: _Operator, n: int) -> None:
        drain = self.draining.setdefault(id(o.op), set())
        drain &= set(o.running())  # forget released replicas
        live = [a for a in o.running() if a not in drain]
        surplus = len(live) + o.pending() - n
        while surplus > 0 and o.cancel_pending():  # replicas not started yet go first
            surplus -= 1
        if surplus > 0:  # then the least busy running ones drain
            live.sort(key=o.in_flight)
            drain.update(live[:surplus])
        elif surplus < 0:  # more wanted: take draining replicas back before starting new ones
            for a in list(drain)[:-surplus]:
                drain.discard(a)
        for a in list(drain):
            o.stop_scheduling(a)  # runs after the pool re-listed it this step
            if o.in_flight(a) == 0:  # its batches are done and committed
                o.release(a)
                drain.discard(a)
        # Below min the autoscaler starts replicas; draining ones do not count against max.
        o.set_bounds(n, len(drain))


def scale(stage: str | None, n: int | None, job: str | None, wait_s: float = 0.0,
          echo=print) -> dict:
    """Set a pool's desired size (stage and n given) and/or show the pools' state; with
    wait_s, poll until the stage's running replicas equal n (or time runs out)."""
    import ray

    if stage is not None and stage not in STAGE_OPERATORS:
        raise ValueError(f"stage {stage!r}: choose one of {', '.join(STAGE_OPERATORS)}")
    if n is not None and n < 1:
        raise ValueError(f"a pool keeps at least 1 replica (asked for {n})")
    control = find_control(job)
    if stage is not None and n is not None:
        ray.get(control.set.remote(stage, n))
        echo(f"{stage}: desired {n} replicas")
    deadline = time.time() + wait_s
    while True:
        status = ray.get(control.status.remote())
        pool = status["pools"].get(stage or "", {})
        done = n is None or pool.get("running") == n and pool.get("draining", 0) == 0
        if done or time.time() >= deadline:
            break
        time.sleep(1.0)
    for s, st in sorted(status["pools"].items()):
        echo(f"{s}: {st['running']} running, {st['draining']} draining, {st['pending']} starting "
             f"(desired {st['desired'] if st['desired'] is not None else 'recipe bounds'}, "
             f"min {st['min']}, max {st['max']}){' [done]' if st['completed'] else ''}")
    if not status["pools"]:
        echo("no pool is running yet (the job is between stages or starting)")
    return status
