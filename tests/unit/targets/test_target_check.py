"""`eagle-ray recipes NAME --check-target DIR`: a checkpoint's config, weight index and tokenizer
against the recipe, without loading weights; and the remote-code opt-in."""

import json

import pytest

from eagle_ray.recipes import load_recipe
from eagle_ray.targets.resolve import resolve_target_path
from eagle_ray.targets.check import check_target_dir

ALLOW = ["target.trust_remote_code=true"]


def fake_kimi(d, *, layers=61, hidden=7168, drop_shard=False, auto_map=True):
    """The small files of a Kimi-K2.5 download (config, index, tokenizer config) with the real
    numbers; the shards are stand-ins (never read)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": {"model_type": "deepseek_v3", "hidden_size": hidden,
                        "num_hidden_layers": layers, "vocab_size": 163840,
                        "num_attention_heads": 64, "intermediate_size": 18432,
                        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64}}))
    names = {"language_model.model.embed_tokens.weight": "model-00001.safetensors",
             "language_model.lm_head.weight": "model-00002.safetensors"}
    for i in range(layers):
        names[f"language_model.model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight"] = \
            f"model-{1 + i % 2:05d}.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    for f in set(names.values()):
        if not (drop_shard and f == "model-00002.safetensors"):
            (d / f).write_bytes(b"x" * 8)
    tc = {"tokenizer_class": "TikTokenTokenizer"}
    if auto_map:
        tc["auto_map"] = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    return d


def test_a_matching_download_passes_once_remote_code_is_allowed(tmp_path):
    d = fake_kimi(tmp_path / "k")
    assert check_target_dir(load_recipe("kimi_k25_8gpu", ALLOW), d) == []
    problems = check_target_dir(load_recipe("kimi_k25_8gpu"), d)
    assert len(problems) == 1 and "trust_remote_code=true" in problems[0]
    assert "tokenization_kimi" in problems[0] and "auto_map" in problems[0]


def test_every_mismatch_is_reported(tmp_path):
    d = fake_kimi(tmp_path / "k", layers=60, hidden=4096, drop_shard=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    problems = "\n".join(check_target_dir(load_recipe("kimi_k25_8gpu", ALLOW), d))
    for needle in ("architecture: recipe says KimiK25ForConditionalGeneration",
                   "text_config.hidden_size: recipe says target.hidden_size=7168, checkpoint has 4096",
                   "text_config.num_hidden_layers: recipe says target.num_layers=61, checkpoint has 60",
                   "missing or empty (incomplete download?): model-00002.safetensors",
                   "missing [60]"):
        assert needle in problems, problems


def test_running_a_remote_code_target_needs_the_users_consent(tmp_path):
    d = fake_kimi(tmp_path / "k")
    with pytest.raises(ValueError, match="allow it with --set target.trust_remote_code=true"):
        resolve_target_path(load_recipe("kimi_k25_8gpu", [f"target.path={d}"]).target)
    assert resolve_target_path(load_recipe("kimi_k25_8gpu", [f"target.path={d}"] + ALLOW).target) == d
    # a checkpoint the recipe does not flag is still caught by its auto_map
    plain = load_recipe("llama31_8b_8gpu", [f"target.path={d}"])
    with pytest.raises(ValueError, match="tokenizer_config.json maps AutoTokenizer"):
        resolve_target_path(plain.target)


def test_cli_check_target_exit_codes(tmp_path, capsys):
    from eagle_ray.cli import main

    d = fake_kimi(tmp_path / "k")
    assert main(["recipes", "kimi_k25_8gpu", "--check-target", str(d)] + ["--set", ALLOW[0]]) == 0
    assert "matches recipe kimi_k25_8gpu" in capsys.readouterr().out
    assert main(["recipes", "llama31_8b_8gpu", "--check-target", str(d)]) == 1
    assert "MISMATCH architecture" in capsys.readouterr().out
