"""Live scaling relies on Ray Data 2.60 internals (eagle_ray/ops/control.py): fail loudly here,
not silently in a job, if an upgrade moves them. The behaviour itself is tested in
tests/integration/test_job.py (scale 1 -> 2 -> 1 while a submitted job extracts)."""

import dataclasses
import inspect

import pytest


def test_ray_data_internals_the_controller_uses_exist():
    from ray.data._internal.actor_autoscaler.autoscaling_actor_pool import AutoscalingActorPool
    from ray.data._internal.execution.operators import actor_pool_map_operator as m
    from ray.data._internal.execution.streaming_executor import StreamingExecutor

    pool_src = inspect.getsource(m._ActorPool)
    for name in ("self._running_actors", "self._alive_actors_to_in_flight_tasks_heap",
                 "self._alive_node_to_actor_heap", "num_tasks_in_flight", "actor_location"):
        assert name in pool_src, name
    for meth in ("_release_running_actor", "_try_remove_pending_actor", "num_pending_actors"):
        assert callable(getattr(m._ActorPool, meth)), meth
    assert "self._actor_pool = " in inspect.getsource(m.ActorPoolMapOperator.__init__)
    assert "self._topology" in inspect.getsource(StreamingExecutor)
    # The bounds are read from the pool's config on every call, and the config is a dataclass
    # with the fields we replace.
    assert "_config" in inspect.getsource(AutoscalingActorPool.min_size)
    cfg_cls = inspect.signature(m._ActorPool.__init__).parameters
    assert any("config" in p for p in cfg_cls)
    from ray.data._internal.actor_autoscaler.autoscaling_actor_pool import AutoscalingActorConfig

    assert {"min_size", "max_size", "initial_size"} <= {f.name for f in dataclasses.fields(AutoscalingActorConfig)}


def test_execution_callback_hook_is_public_context_field():
    import ray.data

    from eagle_ray.ops.control import PoolSizeController

    ctx = ray.data.DataContext.get_current()
    assert isinstance(ctx.custom_execution_callback_classes, list)
    assert PoolSizeController.on_execution_step is not None


def test_scale_refuses_bad_requests():
    from eagle_ray.ops.control import scale

    with pytest.raises(ValueError, match="stage"):
        scale("train", 2, None)
    with pytest.raises(ValueError, match="at least 1"):
        scale("extract", 0, None)
