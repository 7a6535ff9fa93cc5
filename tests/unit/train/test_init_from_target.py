"""train.init_from_target: a fresh drafter started from the target's own weights. Each tensor
taken comes from the right place (the lm_head rows of the draft vocabulary, the final norm,
the last decoder layer, the hidden-state half of q/k/v), the rest is the fresh initialisation
of the same seed; a drafter shaped unlike the target is refused, both shapes named."""

import dataclasses

import pytest
import torch

from eagle_ray.model.vocab import build_draft_vocab, draft_target_ids
from eagle_ray.recipes import load_recipe
from eagle_ray.targets.load import load_embed_and_lm_head, load_tensors, read_config, text_config
from eagle_ray.train.init import target_init_state
from eagle_ray.train.run import drafter_arch


def _setup(tiny_target_dir):
    arch = drafter_arch(load_recipe("tiny_cpu"), tiny_target_dir)
    g = torch.Generator().manual_seed(3)
    d2t, _ = build_draft_vocab(torch.randint(0, 100, (arch.target_vocab_size,), generator=g),
                               arch.draft_vocab_size)
    return arch, d2t


def test_each_tensor_comes_from_its_place_in_the_target(tiny_target_dir):
    arch, d2t = _setup(tiny_target_dir)
    fresh, none = target_init_state(tiny_target_dir, arch, d2t, seed=5, what="lm_head")
    layer, names = target_init_state(tiny_target_dir, arch, d2t, seed=5, what="layer")
    assert none == ["lm_head.weight", "norm.weight"]
    last = int(text_config(read_config(tiny_target_dir))["num_hidden_layers"]) - 1
    t = load_tensors(tiny_target_dir, [f"model.layers.{last}.mlp.down_proj.weight",
                                       f"model.layers.{last}.self_attn.q_proj.weight",
                                       f"model.layers.{last}.input_layernorm.weight",
                                       "model.norm.weight"])
    _, head = load_embed_and_lm_head(tiny_target_dir)
    ids = draft_target_ids(d2t)
    for st in (fresh, layer):
        assert torch.equal(st["lm_head.weight"], head[ids].float())
        assert torch.equal(st["norm.weight"], t["model.norm.weight"].float())
    H = arch.hidden_size
    assert torch.equal(layer["midlayer.mlp.down_proj.weight"], t[f"model.layers.{last}.mlp.down_proj.weight"].float())
    assert torch.equal(layer["midlayer.hidden_norm.weight"], t[f"model.layers.{last}.input_layernorm.weight"].float())
    q = layer["midlayer.self_attn.q_proj.weight"]
    assert torch.equal(q[:, H:], t[f"model.layers.{last}.self_attn.q_proj.weight"].float())
    # the embedding half and everything not taken: the same seed's fresh initialisation
    assert torch.equal(q[:, :H], fresh["midlayer.self_attn.q_proj.weight"][:, :H])
    assert torch.equal(layer["fc.weight"], fresh["fc.weight"])
    assert not torch.equal(fresh["midlayer.mlp.down_proj.weight"], layer["midlayer.mlp.down_proj.weight"])
    assert {"midlayer.self_attn.k_proj.weight", "midlayer.self_attn.o_proj.weight",
            "midlayer.post_attention_layernorm.weight"} <= set(names)
    assert torch.equal(layer["d2t"], fresh["d2t"])


def test_a_drafter_shaped_unlike_the_target_is_refused_naming_both(tiny_target_dir):
    arch, d2t = _setup(tiny_target_dir)
    other = dataclasses.replace(arch, intermediate_size=arch.intermediate_size + 8)
    with pytest.raises(ValueError, match=r"mlp.*_proj.weight is \(.*\), the drafter's is \(.*\)"):
        target_init_state(tiny_target_dir, other, d2t, seed=0, what="layer")
    # the lm_head alone does not depend on the layer's shape
    target_init_state(tiny_target_dir, other, d2t, seed=0, what="lm_head")


def test_config_refuses_two_starting_points_and_unknown_values():
    with pytest.raises(ValueError, match="init_from_target.*choose one of none, lm_head, layer"):
        load_recipe("tiny_cpu", ["train.init_from_target=last"])
    with pytest.raises(ValueError, match="a run starts from one of them"):
        load_recipe("tiny_cpu", ["train.init_from=/some/drafter", "train.init_from_target=layer"])
