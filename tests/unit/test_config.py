import pytest

from eagle_ray.recipes import RECIPES, load_recipe


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipes_load_and_validate(name):
    r = load_recipe(name)
    assert r.name == name
    L = r.target.num_layers
    assert r.target.resolved_aux_layer_ids == (2, L // 2, L - 3)


def test_real_architecture_numbers():
    k = load_recipe("kimi_k25_8gpu").target
    assert (k.hidden_size, k.num_layers, k.vocab_size, k.tensor_parallel_size) == (7168, 61, 163840, 8)
    assert k.resolved_aux_layer_ids == (2, 30, 58)
    ll = load_recipe("llama31_8b_8gpu").target
    assert (ll.hidden_size, ll.num_layers, ll.vocab_size) == (4096, 32, 128256)
    assert load_recipe("tiny_cpu").target.resolved_aux_layer_ids == (2, 4, 5)


def test_overrides_typed():
    r = load_recipe("tiny_cpu", ["storage.dtype=fp8_e4m3", "data.max_seq_len=1_024",
                                 "target.aux_layer_ids=1,3,6", "target.trust_remote_code=true",
                                 "data.num_samples=none"])
    assert r.storage.dtype == "fp8_e4m3" and r.data.max_seq_len == 1024
    assert r.target.aux_layer_ids == (1, 3, 6) and r.target.trust_remote_code is True
    assert r.data.num_samples is None
    assert load_recipe("tiny_cpu", {"generate.temperature": "0.7"}).generate.temperature == 0.7


@pytest.mark.parametrize("override,message", [
    ("storage.dtype=int4", "choose one of"),
    ("nosuch.x=1", "unknown section"),
    ("data.nosuch=1", "no field 'nosuch'"),
    ("data.max_seq_len=abc", "expected int"),
    ("data.max_seq_len=4", "too small"),
    ("target.aux_layer_ids=2,4,99", "within"),
    ("target.aux_layer_ids=2,2,5", "distinct"),
    ("generate.min_replicas=3", "min_replicas <= max_replicas"),
    ("justtext", "key=value"),
])
def test_bad_overrides_say_what_to_fix(override, message):
    with pytest.raises(ValueError, match=message):
        load_recipe("tiny_cpu", [override])


def test_unknown_recipe_lists_known():
    with pytest.raises(ValueError, match="kimi_k25_8gpu"):
        load_recipe("kimi")
