import json

import numpy as np
import pytest

from eagle_ray.data.tokenize import length_columns, render_with_span, tokenize_conversation


def _marked(tok, t):
    """The token strings with loss-masked ones in brackets (for readable failures)."""
    toks = tok.convert_ids_to_tokens(t.input_ids.tolist())
    return "".join(f"[{x}]" if m else x for x, m in zip(toks, t.loss_mask))


def _expected_mask(tok, messages):
    """Independent oracle: tokenize the prompt (with generation prompt) and the generated
    part separately; the generated part is the reasoning block + answer + <|im_end|>."""
    prompt = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    last = messages[-1]
    gen = ""
    if last.get("reasoning_content"):
        gen += "<think>\n" + last["reasoning_content"] + "\n</think>\n"
    gen += last["content"] + "<|im_end|>"
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    g_ids = tok(gen, add_special_tokens=False)["input_ids"]
    tail = tok("\n", add_special_tokens=False)["input_ids"]  # the template's trailing newline
    return p_ids + g_ids + tail, [False] * len(p_ids) + [True] * len(g_ids) + [False] * len(tail)


def test_single_turn_mask_token_by_token(tiny_tokenizer):
    tok = tiny_tokenizer
    msgs = [{"role": "user", "content": "Tell me about the fox."},
            {"role": "assistant", "content": "The fox lives in the forest."}]
    t = tokenize_conversation(tok, msgs, max_seq_len=512)
    ids, mask = _expected_mask(tok, msgs)
    assert t.input_ids.tolist() == ids, _marked(tok, t)
    assert t.loss_mask.tolist() == mask, _marked(tok, t)
    # The masked tokens decode to exactly the assistant's generated text.
    assert tok.decode(t.input_ids[t.loss_mask]) == "The fox lives in the forest.<|im_end|>"
    assert not t.truncated


def test_multi_turn_with_reasoning_masks_only_final_turn(tiny_tokenizer):
    tok = tiny_tokenizer
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 plus 2?"},
            {"role": "assistant", "content": "Four.", "reasoning_content": "old thoughts"},
            {"role": "user", "content": "And 3 times 3?"},
            {"role": "assistant", "content": "The answer is 9.", "reasoning_content": "3 groups of 3."}]
    t = tokenize_conversation(tok, msgs, max_seq_len=512)
    ids, mask = _expected_mask(tok, msgs)
    assert t.input_ids.tolist() == ids, _marked(tok, t)
    assert t.loss_mask.tolist() == mask, _marked(tok, t)
    masked = tok.decode(t.input_ids[t.loss_mask])
    assert masked == "<think>\n3 groups of 3.\n</think>\nThe answer is 9.<|im_end|>"
    # The earlier turn (and its dropped reasoning) is history: never in the loss.
    full = tok.decode(t.input_ids)
    assert "old thoughts" not in full and "Four." in full
    # Scaffolding around the final turn is excluded: the header before, the newline after.
    first = int(np.argmax(t.loss_mask))
    assert tok.decode(t.input_ids[:first]).endswith("<|im_start|>assistant\n")
    assert not t.loss_mask[-1] and tok.decode(t.input_ids[-1:]) == "\n"


def test_truncation_from_the_end(tiny_tokenizer):
    tok = tiny_tokenizer
    msgs = [{"role": "user", "content": "Write a short story with a fox."},
            {"role": "assistant", "content": "One morning, a fox walked to the river. " * 20}]
    full = tokenize_conversation(tok, msgs, max_seq_len=4096)
    n = len(full.input_ids)
    t = tokenize_conversation(tok, msgs, max_seq_len=40)
    assert len(t.input_ids) == 40 and t.truncated and t.num_tokens_untruncated == n
    assert t.input_ids.tolist() == full.input_ids[:40].tolist()  # the start is kept
    assert t.loss_mask.tolist() == full.loss_mask[:40].tolist()
    assert t.loss_mask.sum() == full.loss_mask[:40].sum() > 0


def test_last_message_must_be_assistant(tiny_tokenizer):
    with pytest.raises(ValueError, match="last message"):
        render_with_span(tiny_tokenizer, [{"role": "user", "content": "hi"}])


def test_length_columns_match_per_row_tokenization(tiny_tokenizer):
    tok = tiny_tokenizer
    convs = [
        [{"role": "user", "content": "What is 1 plus 2?"},
         {"role": "assistant", "content": "The answer is 3.", "reasoning_content": "1 and 2."}],
        [{"role": "user", "content": "Tell me a story about a cat and a dog."},
         {"role": "assistant", "content": "A cat met a dog. " * 30}],
    ]
    msgs = [json.dumps(c[:-1]) for c in convs] + [json.dumps([{"role": "user", "content": "Hi"}])]
    refs = [json.dumps(c[-1]) for c in convs] + [None]
    cols = length_columns(tok, msgs, refs, max_seq_len=64, chunk=2)  # chunk boundary inside
    for i, c in enumerate(convs):
        t = tokenize_conversation(tok, c, max_seq_len=64)
        assert cols["num_tokens"][i] == len(t.input_ids)
        assert cols["num_loss_tokens"][i] == int(t.loss_mask.sum())
        assert cols["truncated"][i] == t.truncated
    assert cols["truncated"] == [False, True, False]
    prompt_only = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                          add_generation_prompt=True)
    assert cols["num_tokens"][2] == len(tok(prompt_only, add_special_tokens=False)["input_ids"])
    assert cols["num_loss_tokens"][2] == 0
