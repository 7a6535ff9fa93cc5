"""The serving profile: recipe values win, then the checkpoint's generation_config.json, then
vLLM's neutral values; generation samples at it unless generate.* says otherwise."""

import json

import pytest

from eagle_ray.recipes import load_recipe
from eagle_ray.targets.serving import generation_sampling, sampling_kwargs, serving_profile


def test_kimi_and_tiny_recipes_serve_at_kimi_thinking_mode(tmp_path):
    for name in ("kimi_k25_8gpu", "tiny_kimi_cpu", "tiny_cpu"):
        p = serving_profile(load_recipe(name), tmp_path)
        assert (p["temperature"], p["top_p"], p["top_k"], p["min_p"]) == (1.0, 0.95, 0, 0.0), name
        assert p["from"]["temperature"] == "recipe" and "thinking mode" in p["source"]


def test_unstated_fields_come_from_generation_config_then_neutral(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": -1}))
    r = load_recipe("llama31_8b_8gpu")  # states no serving profile
    p = serving_profile(r, tmp_path)
    assert (p["temperature"], p["top_p"], p["top_k"], p["min_p"]) == (0.6, 0.9, 0, 0.0)
    assert p["from"] == {"temperature": "generation_config.json", "top_p": "generation_config.json",
                         "top_k": "generation_config.json", "min_p": "vllm default"}
    # a --set wins over the checkpoint
    p = serving_profile(load_recipe("llama31_8b_8gpu", ["serve.temperature=0.3"]), tmp_path)
    assert p["temperature"] == 0.3 and p["from"]["temperature"] == "recipe"
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert serving_profile(r, tmp_path)["temperature"] == 0.0


def test_generation_samples_at_the_serving_profile_unless_told(tmp_path):
    s = generation_sampling(load_recipe("tiny_cpu"), tmp_path)
    assert (s["temperature"], s["top_p"], s["as_served"], s["samples_per_prompt"]) == (1.0, 0.95, True, 1)
    g = generation_sampling(load_recipe("tiny_cpu", ["generate.temperature=0"]), tmp_path)
    assert g["temperature"] == 0 and g["top_p"] == 1.0 and not g["as_served"]
    assert sampling_kwargs(s) == {"temperature": 1.0, "top_p": 0.95, "top_k": -1, "min_p": 0.0}


def test_several_samples_per_prompt_need_sampling(tmp_path):
    with pytest.raises(ValueError, match="greedy completions of a prompt are all the same"):
        load_recipe("tiny_cpu", ["generate.samples_per_prompt=4", "generate.temperature=0"])
    r = load_recipe("tiny_cpu", ["generate.samples_per_prompt=4", "serve.temperature=0"])
    with pytest.raises(ValueError, match="serving profile is greedy"):
        generation_sampling(r, tmp_path)
    assert generation_sampling(load_recipe("tiny_cpu", ["generate.samples_per_prompt=4"]),
                               tmp_path)["samples_per_prompt"] == 4


def test_cpu_recipe_turns_chunked_prefill_off_for_seeded_sampling():
    from eagle_ray.vllm.engine import engine_kwargs

    e = engine_kwargs(load_recipe("tiny_cpu"), "/m")
    assert e["enable_chunked_prefill"] is False and e["max_num_batched_tokens"] >= 1024
    assert "enable_chunked_prefill" not in engine_kwargs(load_recipe("kimi_k25_8gpu"), "/m")
    with pytest.raises(ValueError, match="needs engine.max_model_len"):
        load_recipe("llama31_8b_8gpu", ["engine.enable_chunked_prefill=false"])
