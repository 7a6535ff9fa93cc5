import pytest

from eagle_ray.recipes import load_recipe
from eagle_ray.vllm.engine import engine_kwargs, pool_kwargs
from eagle_ray.generate.stage import split_reasoning


@pytest.mark.parametrize("text,started,expected", [
    ("<think>\nI need 2 plus 2.\n</think>\nThe answer is 4.", False, ("I need 2 plus 2.", "The answer is 4.")),
    ("The answer is 4.", False, (None, "The answer is 4.")),
    ("\nplan it\n</think>\n\nDone.", True, ("plan it", "Done.")),       # template opened <think>
    ("<think>\nstill thinking when max_tokens hit", False, ("still thinking when max_tokens hit", "")),
    ("<think>\n\n</think>\nJust the answer.", False, (None, "Just the answer.")),  # empty reasoning
])
def test_split_reasoning(text, started, expected):
    assert split_reasoning(text, "<think>", "</think>", started) == expected


def _g(recipe):
    g = recipe.generate
    return pool_kwargs(recipe, min_size=g.min_replicas, max_size=g.max_replicas,
                       gpus_per_replica=g.gpus_per_replica, batch_size=g.batch_size,
                       num_cpus=recipe.engine.num_cpus_per_replica)


def test_resources_cpu_recipe_requests_no_gpu():
    r = load_recipe("tiny_cpu")
    kw = _g(r)
    assert kw["num_gpus"] == 0 and kw["num_cpus"] == 0.5 and "ray_remote_args_fn" not in kw
    assert kw["runtime_env"]["env_vars"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    e = engine_kwargs(r, "/m")
    assert e["kv_cache_memory_bytes"] == 64 << 20 and e["dtype"] == "float32"
    assert "distributed_executor_backend" not in e


def test_resources_llama_one_gpu_per_replica_autoscaling():
    r = load_recipe("llama31_8b_8gpu")
    kw = _g(r)
    assert kw["num_gpus"] == 1 and "ray_remote_args_fn" not in kw
    assert (kw["compute"].min_size, kw["compute"].max_size) == (2, 8)
    assert "gpu_memory_utilization" in engine_kwargs(r, "/m")


def test_resources_kimi_tp8_placement_group():
    r = load_recipe("kimi_k25_8gpu")
    kw = _g(r)
    assert kw["num_gpus"] == 0 and "ray_remote_args_fn" not in kw  # vLLM builds the TP group
    e = engine_kwargs(r, "/m")
    assert e["tensor_parallel_size"] == 8 and e["distributed_executor_backend"] == "ray"
    with pytest.raises(ValueError, match="tensor_parallel_size=8"):
        load_recipe("kimi_k25_8gpu", ["generate.gpus_per_replica=1"])
