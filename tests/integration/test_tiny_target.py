"""The tiny target loads in HF transformers and in real vLLM (CPU) and is not degenerate."""

import hashlib
import os

import pytest

pytestmark = pytest.mark.integration

PROMPTS = [
    [{"role": "user", "content": "Tell me about the owl."}],
    [{"role": "user", "content": "What is 3 plus 4?"}],
    [{"role": "system", "content": "Answer briefly and clearly."},
     {"role": "user", "content": "Write a short story with a fox."}],
    [{"role": "user", "content": "Which animals live in the lake?"}],
    [{"role": "user", "content": "How do I bake bread?"}],  # out of distribution
]
MAX_NEW = 48


def distinct_ratio(ids):
    return len(set(ids)) / len(ids)


@pytest.fixture(scope="module")
def hf_greedy(tiny_target_dir, tiny_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_target_dir), dtype=torch.float32)
    outs = []
    for msgs in PROMPTS:
        enc = tiny_tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False)
        outs.append(out[0, enc["input_ids"].shape[1]:].tolist())
    return outs


def test_hf_loads_and_is_not_degenerate(hf_greedy, tiny_tokenizer):
    ratios = [distinct_ratio(ids) for ids in hf_greedy]
    texts = [tiny_tokenizer.decode(ids) for ids in hf_greedy]
    print("distinct-token ratios:", [round(r, 3) for r in ratios])
    assert min(ratios) > 0.4, (ratios, texts)
    for ids in hf_greedy:  # no token repeated back to back more than twice
        runs = max(sum(1 for _ in g) for _, g in __import__("itertools").groupby(ids))
        assert runs <= 2, ids
    # The reasoning path of the chat template is exercised by the model itself.
    assert texts[1].startswith("<think>\n") and "</think>" in texts[1]
    assert texts[0].endswith("<|im_end|>")


def test_vllm_loads_and_matches_hf_greedy(tiny_target_dir, hf_greedy, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(tiny_target_dir), dtype="float32", enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, max_model_len=1024, seed=0)
    try:
        outs = llm.chat(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
        got = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        del llm
    # HF keeps generating past eos only when max_new_tokens allows; compare up to vLLM's stop.
    for v, h in zip(got, hf_greedy):
        assert v == h[:len(v)], (v, h)
        assert len(v) == len(h) or h[len(v) - 1] == 2  # vLLM stopped at <|im_end|>


def test_build_is_deterministic(tmp_path):
    from eagle_ray.targets.tiny.target import build_tiny_target

    digests = []
    for name in ("a", "b"):
        build_tiny_target(tmp_path / name, seed=3, train_steps=3)
        digests.append({f: hashlib.sha256((tmp_path / name / f).read_bytes()).hexdigest()
                        for f in ("model.safetensors", "tokenizer.json", "config.json")})
    assert digests[0] == digests[1]
    assert os.path.getsize(tmp_path / "a" / "model.safetensors") > 1_000_000
