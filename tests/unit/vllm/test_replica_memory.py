"""What an engine replica asks Ray for in host memory (engine.memory_per_replica_bytes)."""

import dataclasses

import torch
from safetensors.torch import save_file

from eagle_ray.recipes import load_recipe
from eagle_ray.vllm.engine import REPLICA_BASE_BYTES, checkpoint_weights, replica_memory_bytes


def test_estimate_counts_weights_at_the_engine_dtype_and_the_kv_cache(tmp_path):
    save_file({"a": torch.zeros(100, 10, dtype=torch.bfloat16), "b": torch.zeros(7, dtype=torch.bfloat16)},
              str(tmp_path / "model-1.safetensors"))
    save_file({"c": torch.zeros(3, 3)}, str(tmp_path / "model-2.safetensors"))
    assert checkpoint_weights(tmp_path) == (1016, 1007 * 2 + 9 * 4)
    r = load_recipe("tiny_cpu")  # float32, a 64 MiB KV cache
    assert replica_memory_bytes(r, 0, tmp_path) == int(1.25 * (REPLICA_BASE_BYTES + 1016 * 4 + (64 << 20)))
    auto = dataclasses.replace(r, engine=dataclasses.replace(r.engine, dtype="auto"))
    assert replica_memory_bytes(auto, 0, tmp_path) == int(1.25 * (REPLICA_BASE_BYTES + 2014 + 36 + (64 << 20)))
    # On a GPU the weights and the KV cache are in GPU memory: the process only.
    assert replica_memory_bytes(r, 1, tmp_path) == int(1.25 * REPLICA_BASE_BYTES)
    # The recipe's own figure wins.
    mine = load_recipe("tiny_cpu", ["engine.memory_per_replica_bytes=123456789"])
    assert replica_memory_bytes(mine, 0, tmp_path) == 123456789
