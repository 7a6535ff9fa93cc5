"""EAGLE-3 features captured with real vLLM (CPU) equal HF transformers' hidden states.

Contract (eagle_ray.extract.vllm_capture): aux for layer i = HF hidden_states[i] (the
residual stream entering layer i), final = HF hidden_states[-1] (post final norm), and
lm_head(final) = the target's logits.
"""

import os

import pytest
import torch

pytestmark = pytest.mark.integration

AUX = (2, 4, 5)
ATOL = 1e-4  # measured max abs error on this machine: ~5e-6 (float32 on both sides)
LOGITS_ATOL = 1e-3
ENGINE = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              max_model_len=1024, seed=0)
MAX_ERR: dict[str, float] = {}


def seqs(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1024, (n,), generator=g).tolist() for n in lengths]


# A prefix longer than the CPU KV block size (128 tokens), so prefix caching can hit.
PREFIX = seqs(300, seed=1)[0]


@pytest.fixture(scope="module")
def hf_model(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), dtype=torch.float32).eval()


def hf_ref(model, seq):
    with torch.no_grad():
        out = model(torch.tensor([seq]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states], out.logits[0]


def assert_matches(model, sequences, got, tag):
    assert len(got) == len(sequences)
    for seq, (aux, final) in zip(sequences, got):
        hs, logits = hf_ref(model, seq)
        T, H = len(seq), hs[0].shape[-1]
        assert aux.shape == (T, len(AUX) * H) and final.shape == (T, H)
        assert aux.dtype == final.dtype == torch.float32
        assert aux.device.type == final.device.type == "cpu"
        ref = torch.cat([hs[i] for i in AUX], dim=-1)
        errs = {"aux": (aux - ref).abs().max().item(),
                "final": (final - hs[-1]).abs().max().item()}
        with torch.no_grad():
            errs["logits"] = (model.lm_head(final) - logits).abs().max().item()
        for k, v in errs.items():
            MAX_ERR[k] = max(MAX_ERR.get(k, 0.0), v)
        print(f"{tag} T={T}: max abs err {errs}")
        assert errs["aux"] < ATOL and errs["final"] < ATOL, (tag, T, errs)
        assert errs["logits"] < LOGITS_ATOL, (tag, T, errs)


@pytest.fixture(scope="class")
def cap(tiny_target_dir):
    """One engine (prefix caching off, the default) per test class, closed after it."""
    from eagle_ray.extract.vllm_capture import VllmCapture

    c = VllmCapture(str(tiny_target_dir), AUX, ENGINE)
    yield c
    tmp = c._dir
    c.close()
    assert not os.path.exists(tmp), "temporary directory left behind"
    print("max abs errors over all comparisons:", MAX_ERR)


class TestDefaultEngine:
    def test_batch_of_one(self, cap, hf_model):
        s = seqs(17)
        assert_matches(hf_model, s, cap.capture(s), "bs1")

    def test_batch_of_mixed_lengths(self, cap, hf_model):
        s = seqs(5, 37, 120, 3, seed=2)
        assert_matches(hf_model, s, cap.capture(s), "mixed")
        assert os.listdir(cap._dir) == []  # files are removed once read

    def test_shared_prefix_in_one_batch_and_across_calls(self, cap, hf_model):
        s = [PREFIX + [1, 2, 3], PREFIX + [4, 5, 6, 7, 8], PREFIX + [1, 2, 3]]
        assert_matches(hf_model, s, cap.capture(s), "prefix-batch")
        s2 = [PREFIX + [9] * 20, PREFIX[:150]]
        assert_matches(hf_model, s2, cap.capture(s2), "prefix-again")

    def test_longest_sequence(self, cap, hf_model):
        s = seqs(ENGINE["max_model_len"] - 1, seed=3)  # one sampled token must still fit
        assert_matches(hf_model, s, cap.capture(s), "longest")

    def test_wrong_layers_do_not_match(self, cap, hf_model):
        """The comparison can fail: the states of neighbouring layers, the pre-norm last
        layer and another sequence's states are all far outside the tolerance."""
        s = seqs(40, 41, seed=4)
        (aux, final), (aux_b, _) = cap.capture(s)
        hs, _ = hf_ref(hf_model, s[0])
        for shift in (-1, 1):
            ref = torch.cat([hs[i + shift] for i in AUX], dim=-1)
            assert (aux - ref).abs().max().item() > 100 * ATOL, shift
        assert (final - hs[-2]).abs().max().item() > 100 * ATOL
        assert (aux_b[:40] - aux).abs().max().item() > 100 * ATOL

    def test_bad_layer_ids_are_refused(self, tiny_target_dir):
        from eagle_ray.extract.vllm_capture import VllmCapture

        for ids in [(2, 8), (2, 2, 4), (), (-1, 3)]:  # 8 = L: its output is pre-norm, not HF's
            with pytest.raises(ValueError):
                VllmCapture(str(tiny_target_dir), ids, ENGINE)


def test_prefix_caching_and_chunked_prefill(tiny_target_dir, hf_model):
    """Opt-in prefix caching: a later request that reuses a cached prefix still gets every
    token's states (the hidden-states cache blocks are prefix-cached too). Chunked prefill
    (64-token chunks) splits one request's states over several steps."""
    from eagle_ray.extract.vllm_capture import VllmCapture

    cap = VllmCapture(str(tiny_target_dir), AUX,
                      dict(ENGINE, enable_prefix_caching=True, max_num_batched_tokens=64))
    cached = []
    generate = cap.llm.generate

    def spy(*a, **k):
        outs = generate(*a, **k)
        cached.extend(o.num_cached_tokens for o in outs)
        return outs

    cap.llm.generate = spy
    try:
        first = [PREFIX + [1, 2, 3]]
        assert_matches(hf_model, first, cap.capture(first), "pc-first")
        later = [PREFIX + [4, 5, 6, 7, 8], PREFIX + [7] * 30]
        assert_matches(hf_model, later, cap.capture(later), "pc-later")
    finally:
        cap.close()
    assert cached[0] == 0 and min(cached[1:]) >= 256, cached  # the prefix really was reused
