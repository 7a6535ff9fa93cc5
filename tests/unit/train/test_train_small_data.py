"""A store too small for one optimizer step is refused by the driver, before any Ray worker
starts, with a message that says what to change."""

import numpy as np
import pytest
import torch

from eagle_ray.recipes import load_recipe
from eagle_ray.store.format import StoreManifest
from eagle_ray.store.writer import SampleFeatures, StoreWriter


def tiny_store(d, n, tiny_target_dir):
    from eagle_ray.common.provenance import target_fingerprint, tokenizer_fingerprint
    from eagle_ray.targets.tiny.target import TINY_ARCH

    H = TINY_ARCH["hidden_size"]
    m = StoreManifest(target_path=str(tiny_target_dir), target_revision=None,
                      target_fingerprint=target_fingerprint(tiny_target_dir), architecture="LlamaForCausalLM",
                      hidden_size=H, num_layers=TINY_ARCH["num_layers"], vocab_size=TINY_ARCH["vocab_size"],
                      aux_layer_ids=(2, 4, 5), dtype="bf16", max_seq_len=512,
                      tokenizer_fingerprint=tokenizer_fingerprint(tiny_target_dir))
    g = torch.Generator().manual_seed(0)
    ss = [SampleFeatures(sample_id=f"s{i}", source="src", input_ids=np.arange(40, dtype=np.int32) + i,
                         loss_mask=np.ones(40, dtype=bool), aux=torch.randn(40, 3 * H, generator=g),
                         final=torch.randn(40, H, generator=g), num_tokens_untruncated=40)
          for i in range(n)]
    StoreWriter(d, m).write_shard(ss)
    return d


def test_a_store_too_small_for_one_step_is_refused_before_ray(tmp_path, tiny_target_dir, monkeypatch):
    import eagle_ray.ops.cluster
    from eagle_ray.train.run import run_train

    def no_ray(*a, **k):
        raise AssertionError("Ray was started before the store was found too small")

    monkeypatch.setattr(eagle_ray.ops.cluster, "init_ray", no_ray)

    store = tiny_store(tmp_path / "store", 4, tiny_target_dir)  # 3 train + 1 held out
    r = load_recipe("tiny_cpu", ["train.num_workers=2", "train.grad_accum=2",
                                 "train.tokens_per_batch=64"])
    with pytest.raises(ValueError) as e:
        run_train(r, store, tmp_path / "run")
    msg = str(e.value)
    assert "not enough training data for one optimizer step" in msg
    assert "3 training samples" in msg and "2 x 2 = 4" in msg
    assert "--set train.num_workers=" in msg
