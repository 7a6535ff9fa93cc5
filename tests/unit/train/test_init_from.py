"""train.init_from: a published drafter in vLLM's (eagle_ray/SpecForge) layout and in
vllm-project/speculators' layout reads to the same tensors; mismatches are refused, named;
init_vocab=data carries each surviving token's lm_head row to its new slot."""

import json

import pytest
import torch
from safetensors.torch import save_file

from eagle_ray.export.vllm_layout import state_dict_for_export, vllm_config
from eagle_ray.model import Eagle3Drafter, build_draft_vocab, drafter_arch_from
from eagle_ray.train.init import check_published, init_state, published_d2t, read_published

H, V, N = 32, 64, 24
MANIFEST = {"hidden_size": H, "vocab_size": V, "num_layers": 8, "aux_layer_ids": [2, 4, 5]}


def _arch(**kw):
    a = dict(hidden_size=H, num_heads=2, kv_heads=1, head_dim=16, intermediate=48,
             target_vocab=V, draft_vocab=N, rope_theta=10000.0)
    a.update(kw)
    return drafter_arch_from(a.pop("hidden_size"), a.pop("num_heads"), a.pop("kv_heads"),
                             a.pop("head_dim"), a.pop("intermediate"), a.pop("target_vocab"),
                             a.pop("draft_vocab"), **a)


def _model(seed=0, counts_seed=1):
    g = torch.Generator().manual_seed(counts_seed)
    d2t, _ = build_draft_vocab(torch.randint(0, 100, (V,), generator=g), N)
    torch.manual_seed(seed)
    return Eagle3Drafter(_arch(), d2t=d2t)


def write_vllm(model, d, aux=(2, 4, 5)):
    d.mkdir(parents=True)
    cfg = vllm_config(model.arch, {"hidden_size": H, "vocab_size": V}, list(aux), dtype="float32")
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(state_dict_for_export(model), str(d / "model.safetensors"))
    return d


def write_speculators(model, d, aux=(2, 4, 5)):
    """The same drafter as vllm-project/speculators saves one (their Eagle3SpeculatorConfig
    and tensor names: layers.0.*, a frozen embed_tokens copy)."""
    d.mkdir(parents=True)
    a = model.arch
    cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3DraftModel"],
           "speculators_version": "0.3.0", "draft_vocab_size": a.draft_vocab_size,
           "norm_before_residual": False, "target_hidden_size": H,
           "eagle_aux_hidden_state_layer_ids": list(aux),
           "transformer_layer_config": {
               "model_type": "llama", "hidden_size": H, "intermediate_size": a.intermediate_size,
               "num_hidden_layers": 1, "num_attention_heads": a.num_attention_heads,
               "num_key_value_heads": a.num_key_value_heads, "head_dim": a.head_dim,
               "vocab_size": V, "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta,
               "max_position_embeddings": a.max_position_embeddings},
           "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
               {"proposal_type": "greedy", "speculative_tokens": 5}],
               "verifier": {"name_or_path": "target"}}}
    (d / "config.json").write_text(json.dumps(cfg))
    sd = {(k.replace("midlayer.", "layers.0.", 1)): v for k, v in state_dict_for_export(model).items()}
    sd["embed_tokens.weight"] = torch.randn(V, H)
    save_file(sd, str(d / "model.safetensors"))
    return d


def test_both_layouts_read_to_identical_tensors(tmp_path):
    m = _model()
    a = read_published(write_vllm(m, tmp_path / "vllm"))
    b = read_published(write_speculators(m, tmp_path / "spec"))
    assert (a.layout, b.layout) == ("vllm", "speculators")
    assert set(a.state) == set(b.state) and "embed_tokens.weight" not in b.state
    for k in a.state:
        assert torch.equal(a.state[k], b.state[k]), k
    assert a.config == b.config
    check_published(a, _arch(), MANIFEST, "keep")
    check_published(b, _arch(), MANIFEST, "keep")
    state, rows = init_state(b, _arch(), published_d2t(b), seed=0)
    ref = m.state_dict()
    assert all(torch.equal(state[k], ref[k]) for k in ref) and rows["fresh_rows"] == 0


def test_mismatches_are_refused_each_named(tmp_path):
    m = _model()
    pub = read_published(write_vllm(m, tmp_path / "d", aux=(1, 4, 6)))
    with pytest.raises(ValueError) as e:
        check_published(pub, _arch(intermediate=64), {**MANIFEST, "hidden_size": 48}, "keep")
    msg = str(e.value)
    assert "aux layer ids [1, 4, 6] vs the features' [2, 4, 5]" in msg
    assert "target hidden size 32 vs the target's 48" in msg
    assert "intermediate_size 48 vs the recipe's drafter 64 (--set drafter.intermediate_size=48)" in msg
    with pytest.raises(ValueError, match=r"draft vocabulary 24 vs the recipe's 30 .*init_vocab=data"):
        check_published(read_published(write_vllm(m, tmp_path / "e")), _arch(draft_vocab=30),
                        MANIFEST, "keep")
    spec = write_speculators(m, tmp_path / "s")
    cfg = json.loads((spec / "config.json").read_text())
    del cfg["norm_before_residual"]  # vLLM reads the missing key as True
    (spec / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="norm_before_residual=true"):
        check_published(read_published(spec), _arch(), MANIFEST, "keep")


def test_init_vocab_data_carries_each_tokens_row_to_its_new_slot(tmp_path):
    m = _model(counts_seed=1)
    pub = read_published(write_vllm(m, tmp_path / "d"))
    old_ids = (torch.arange(N) + m.d2t).tolist()
    g = torch.Generator().manual_seed(7)  # other data: another top-N vocabulary
    new_d2t, _ = build_draft_vocab(torch.randint(0, 100, (V,), generator=g), N)
    new_ids = (torch.arange(N) + new_d2t).tolist()
    assert new_ids != old_ids and set(new_ids) & set(old_ids)
    state, rows = init_state(pub, _arch(), new_d2t, seed=3)
    fresh = Eagle3Drafter(_arch(), d2t=new_d2t)
    torch.manual_seed(3)
    fresh = Eagle3Drafter(_arch(), d2t=new_d2t).state_dict()["lm_head.weight"]
    old_lm = m.lm_head.weight.detach()
    carried = 0
    for i, t in enumerate(new_ids):
        if t in old_ids:  # token t's row, wherever it sat before
            assert torch.equal(state["lm_head.weight"][i], old_lm[old_ids.index(t)])
            carried += 1
        else:
            assert torch.equal(state["lm_head.weight"][i], fresh[i])
    moved = [t for t in new_ids if t in old_ids and new_ids.index(t) != old_ids.index(t)]
    assert moved, "the test needs tokens whose slot changed"
    assert rows == {"carried_rows": carried, "fresh_rows": N - carried}
    assert torch.equal(state["d2t"], new_d2t)
    Eagle3Drafter(_arch(), d2t=new_d2t).load_state_dict(state, strict=True)
