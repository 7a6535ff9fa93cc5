"""A recipe derived from a checkpoint directory (targets/derive.py): the built targets and a
synthetic big one (config.json plus a sparse weight file: nothing is loaded)."""

import json
import subprocess
import sys

import pytest

from eagle_ray.recipes import from_target as recipe_from_target, load_recipe, tiny_cpu, tiny_kimi_cpu
from eagle_ray.targets.check import check_target_dir
from eagle_ray.targets.derive import tensor_parallel_for


def test_tiny_target_derives_what_tiny_cpu_says(tiny_target_dir):
    r = recipe_from_target(tiny_target_dir, gpu_bytes=None)
    t, want = r.target, tiny_cpu().target
    assert (t.architecture, t.hidden_size, t.num_layers, t.vocab_size, t.num_attention_heads,
            t.intermediate_size) == (want.architecture, want.hidden_size, want.num_layers,
                                     want.vocab_size, want.num_attention_heads, want.intermediate_size)
    assert r.target.resolved_aux_layer_ids == want.resolved_aux_layer_ids
    assert (r.drafter.head_dim, r.drafter.num_key_value_heads) == (32, 4)
    assert r.engine.dtype == "float32" and r.engine.enforce_eager and not r.engine.language_model_only
    assert check_target_dir(r, tiny_target_dir) == []


def test_kimi_twin_derives_a_text_only_mla_recipe():
    from eagle_ray.targets.tiny.kimi import ensure_tiny_kimi

    d = ensure_tiny_kimi()
    r = recipe_from_target(d, gpu_bytes=None)
    want = tiny_kimi_cpu()
    assert r.target.architecture == "KimiK25ForConditionalGeneration"
    assert (r.target.hidden_size, r.target.num_layers, r.target.intermediate_size) == \
        (want.target.hidden_size, want.target.num_layers, want.target.intermediate_size)
    # MLA: the config's head_dim-like fields are rope widths; the drafter's layer is Llama's.
    assert (r.drafter.head_dim, r.drafter.num_key_value_heads) == (want.drafter.head_dim,
                                                                   want.drafter.num_key_value_heads)
    assert r.engine.language_model_only and r.engine.attention_backend == "CPU_MLA"
    assert check_target_dir(r, d) == []


def _big(tmp_path, weights_gb: float, **cfg):
    d = tmp_path / "big"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 36,
        "vocab_size": 151936, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 12288, **cfg}))
    with open(d / "model-00001-of-00001.safetensors", "wb") as f:
        f.truncate(int(weights_gb * 1e9))  # sparse: its size, no disk
    return d


@pytest.mark.parametrize("gb, tp", [(16, 1), (150, 2), (600, 8), (2000, 8)])
def test_gpu_recipe_takes_as_many_gpus_as_the_weights_need(tmp_path, gb, tp):
    r = recipe_from_target(_big(tmp_path, gb), gpu_bytes=141 * 10**9)
    assert r.target.tensor_parallel_size == tp
    assert r.generate.gpus_per_replica == r.extract.gpus_per_replica == tp
    assert r.extract.max_replicas == 8 // tp
    assert r.extract.placement == ("colocated" if tp == 8 else "separate")
    assert (r.drafter.head_dim, r.drafter.num_key_value_heads, r.drafter.draft_vocab_size) == (128, 8, 32000)


def test_tensor_parallel_rule():
    assert tensor_parallel_for(10, 100) == 1 and tensor_parallel_for(80, 100) == 2


def test_every_command_takes_a_directory_or_auto(tiny_target_dir):
    a = load_recipe(str(tiny_target_dir), ["train.max_steps=7"])
    b = load_recipe("auto", [f"target.path={tiny_target_dir}", "train.max_steps=7"])
    assert a == b and a.train.max_steps == 7 and a.name == "auto"
    with pytest.raises(ValueError, match="--set target.path=DIR"):
        load_recipe("auto", [])
    with pytest.raises(ValueError, match="unknown recipe 'nope'.*checkpoint directory"):
        load_recipe("nope")


def test_a_config_without_a_decoders_fields_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], "hidden_size": 8}))
    with pytest.raises(ValueError, match="does not give num_hidden_layers"):
        recipe_from_target(tmp_path, gpu_bytes=None)


def test_cli_prints_the_derived_recipe_and_its_check(tiny_target_dir):
    p = subprocess.run([sys.executable, "-m", "eagle_ray.cli", "recipes", "--from-target", str(tiny_target_dir)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["target"]["path"] == str(tiny_target_dir.resolve())
    assert "derived recipe matches the checkpoint" in p.stderr


def test_on_the_cpu_the_drafter_is_what_the_defaults_study_measured_best(tmp_path):
    """A CPU machine trains for hours on a few cores: draft vocabulary 8,192, 1 TTT step and
    a constant learning rate (the study's winners at equal training time on SmolLM2); a GPU
    keeps the published 32,000 and 7, and cosine decay. SmolLM2's recipe agrees."""
    from eagle_ray.recipes import smollm2_cpu

    d = _big(tmp_path, 16)
    cpu, gpu = recipe_from_target(d, gpu_bytes=None), recipe_from_target(d, gpu_bytes=141 * 10**9)
    assert (cpu.drafter.draft_vocab_size, cpu.drafter.ttt_steps, cpu.train.lr_schedule) == (8192, 1, "constant")
    assert (gpu.drafter.draft_vocab_size, gpu.drafter.ttt_steps, gpu.train.lr_schedule) == (32000, 7, "cosine")
    s = smollm2_cpu()
    assert (s.drafter.draft_vocab_size, s.drafter.ttt_steps, s.train.lr_schedule) == (8192, 1, "constant")
