"""Chat template -> input_ids + loss_mask, truncated from the end.

The loss mask covers exactly what the target *generates* in the final assistant turn:
its reasoning block (when the template renders one), its answer, and the end-of-turn
token that stops generation. It excludes the conversation history and the template
scaffolding (role headers such as "<|im_start|>assistant\\n", and anything the template
appends after the end-of-turn token, such as a trailing newline).

How the span is found (template-agnostic, but checked):

    prefix = render(history, add_generation_prompt=True)   "...<|im_start|>assistant\\n"
    full   = render(history + [final])                      prefix + "<think>..</think>\\nANSWER<|im_end|>\\n"
                                                             ^ span start          span end ^ (after eos)
A template whose full rendering does not start with its generation-prompt rendering
cannot be masked this way and raises ValueError naming the sample.
Tokens are assigned to the span by their character offsets in `full`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


@dataclass(frozen=True)
class Tokenized:
    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] bool
    num_tokens_untruncated: int

    @property
    def truncated(self) -> bool:
        return self.num_tokens_untruncated > len(self.input_ids)


def _eos_strings(tokenizer) -> list[str]:
    eos = tokenizer.eos_token
    strings = [eos] if isinstance(eos, str) and eos else []
    # Templates often end turns with a dedicated token that differs from eos (Llama 3's
    # <|eot_id|>); the generation config's eos ids name them all.
    ids = getattr(getattr(tokenizer, "generation_config", None), "eos_token_id", None)
    for i in ([ids] if isinstance(ids, int) else ids or []):
        s = tokenizer.convert_ids_to_tokens(i)
        if s and s not in strings:
            strings.append(s)
    return strings


def render_with_span(tokenizer, messages: Sequence[dict[str, Any]]) -> tuple[str, int, int]:
    """Full chat text and the [start, end) character span of the final assistant turn's
    generated text (reasoning + answer + end-of-turn token)."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("the last message must be the assistant turn to learn from")
    prefix = tokenizer.apply_chat_template(list(messages[:-1]), tokenize=False,
                                           add_generation_prompt=True)
    full = tokenizer.apply_chat_template(list(messages), tokenize=False)
    if not full.startswith(prefix):
        raise ValueError(
            "chat template is not prefix-stable: rendering the conversation does not start with "
            "rendering its history plus the generation prompt, so the assistant span is ambiguous")
    content = messages[-1]["content"]
    end = full.rfind(content)
    if end < len(prefix):
        raise ValueError("the final assistant content does not appear in the rendered template")
    end += len(content)
    for eos in _eos_strings(tokenizer):
        if full.startswith(eos, end):
            end += len(eos)
            break
    return full, len(prefix), end


def _span_mask(offsets: np.ndarray, start: int, end: int) -> np.ndarray:
    """Tokens whose characters lie inside [start, end) (offsets: [T, 2] char spans)."""
    return (offsets[:, 0] >= start) & (offsets[:, 1] <= end) & (offsets[:, 1] > offsets[:, 0])


def tokenize_conversation(tokenizer, messages: Sequence[dict[str, Any]],
                          max_seq_len: int) -> Tokenized:
    """input_ids and loss_mask for one conversation whose last message is the assistant turn."""
    full, start, end = render_with_span(tokenizer, messages)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    mask = _span_mask(offsets, start, end)
    n = len(ids)
    return Tokenized(input_ids=ids[:max_seq_len], loss_mask=mask[:max_seq_len],
                     num_tokens_untruncated=n)


def length_columns(tokenizer, messages_col: Sequence[str], reference_col: Sequence[str | None],
                   max_seq_len: int, *, chunk: int = 8192) -> dict[str, list]:
    """Token counts per prompts.parquet row, for stats and planning (batched encode).

    Rows with a reference response count the whole conversation as a training sample would
    be before regeneration; rows without one count their prompt (+ generation prompt) and
    have 0 loss tokens until generation adds a response.
    """
    out: dict[str, list] = {"prompt_tokens": [], "num_tokens": [], "num_loss_tokens": [],
                            "truncated": []}
    for lo in range(0, len(messages_col), chunk):
        texts, spans = [], []
        for messages_json, reference_json in zip(messages_col[lo:lo + chunk],
                                                 reference_col[lo:lo + chunk]):
            prompt = json.loads(messages_json)
            if reference_json is None:
                text = tokenizer.apply_chat_template(prompt, tokenize=False,
                                                     add_generation_prompt=True)
                texts.append(text)
                spans.append((len(text), len(text)))
            else:
                full, start, end = render_with_span(tokenizer, prompt + [json.loads(reference_json)])
                texts.append(full)
                spans.append((start, end))
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for offs, (start, end) in zip(enc["offset_mapping"], spans):
            o = np.asarray(offs, dtype=np.int64).reshape(-1, 2)
            n = len(o)
            mask = _span_mask(o, start, end)[:max_seq_len]
            out["prompt_tokens"].append(int((o[:, 0] < start).sum()))
            out["num_tokens"].append(min(n, max_seq_len))
            out["num_loss_tokens"].append(int(mask.sum()))
            out["truncated"].append(n > max_seq_len)
    return out


def load_tokenizer(target):
    """The target's tokenizer (with its chat template); builds the tiny target on first use."""
    from transformers import AutoTokenizer

    from eagle_ray.targets.resolve import resolve_target_path

    return AutoTokenizer.from_pretrained(str(resolve_target_path(target)),
                                         revision=target.revision,
                                         trust_remote_code=target.trust_remote_code)


def length_annotator(recipe):
    """An `ingest(annotate=...)` callback adding token-count columns with the recipe's tokenizer."""
    import pyarrow as pa

    tokenizer = load_tokenizer(recipe.target)

    def annotate(table: pa.Table) -> pa.Table:
        cols = length_columns(tokenizer, table.column("messages").to_pylist(),
                              table.column("reference").to_pylist(), recipe.data.max_seq_len)
        types = {"prompt_tokens": pa.int32(), "num_tokens": pa.int32(),
                 "num_loss_tokens": pa.int32(), "truncated": pa.bool_()}
        for name, values in cols.items():
            table = table.append_column(name, pa.array(values, type=types[name]))
        return table

    return annotate
