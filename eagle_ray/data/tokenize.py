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
import sys
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


def render_with_span(tokenizer, messages: Sequence[dict[str, Any]],
                     tools: list[dict] | None = None) -> tuple[str, int, int]:
    """Full chat text and the [start, end) character span of the final assistant turn's
    generated text (reasoning + answer + tool calls + end-of-turn token)."""
    return render_with_spans(tokenizer, [messages], [tools])[0]


def render_with_spans(tokenizer, conversations: Sequence[Sequence[dict[str, Any]]],
                      tools: Sequence[list[dict] | None] | None = None,
                      ) -> list[tuple[str, int, int]]:
    """`render_with_span` of many conversations (rows without tools in two batched template
    calls). A final turn with tool calls ends at the template's end-of-turn token after the
    calls; one without ends at its content's end (+ the end-of-turn token)."""
    from eagle_ray.data.chat import render

    for messages in conversations:
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("the last message must be the assistant turn to learn from")
    if not conversations:
        return []
    prefixes = render(tokenizer, [list(m[:-1]) for m in conversations], tools,
                      add_generation_prompt=True)
    fulls = render(tokenizer, [list(m) for m in conversations], tools)
    eos_strings = _eos_strings(tokenizer)
    out = []
    for messages, prefix, full in zip(conversations, prefixes, fulls):
        if not full.startswith(prefix):
            raise ValueError(
                "chat template is not prefix-stable: rendering the conversation does not start "
                "with rendering its history plus the generation prompt, so the assistant span is "
                "ambiguous")
        final = messages[-1]
        if final.get("tool_calls"):
            # The calls follow the content in tool-use templates: the turn ends at the first
            # end-of-turn token after the content.
            anchor = len(prefix) + len(final.get("content") or "")
            ends = [(full.find(eos, anchor), eos) for eos in eos_strings]
            ends = [(e, eos) for e, eos in ends if e >= 0]
            if not ends:
                raise ValueError("the final assistant turn's tool calls are not followed by an "
                                 "end-of-turn token in the rendered template")
            e, eos = min(ends)
            out.append((full, len(prefix), e + len(eos)))
            continue
        content = final["content"]
        end = full.rfind(content)
        if end < len(prefix):
            raise ValueError("the final assistant content does not appear in the rendered template")
        end += len(content)
        for eos in eos_strings:
            if full.startswith(eos, end):
                end += len(eos)
                break
        out.append((full, len(prefix), end))
    return out


def _span_mask(offsets: np.ndarray, start: int, end: int) -> np.ndarray:
    """Tokens whose characters lie inside [start, end) (offsets: [T, 2] char spans)."""
    return (offsets[:, 0] >= start) & (offsets[:, 1] <= end) & (offsets[:, 1] > offsets[:, 0])


def assistant_spans(tokenizer, messages: Sequence[dict[str, Any]],
                    tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """Full chat text and the [start, end) span of EVERY assistant turn as the template
    renders it in the conversation (earlier turns as history: a template may drop their
    reasoning), each from the end of its generation prompt through its end-of-turn token.

        prefix_j = render(messages[:j], add_generation_prompt=True)   must start `full`
        span_j   = [len(prefix_j), the first end-of-turn token after its content, inclusive]
    """
    from eagle_ray.data.chat import render

    full = render(tokenizer, [list(messages)], [tools])[0]
    eos_strings = _eos_strings(tokenizer)
    turns = [j for j, m in enumerate(messages) if m.get("role") == "assistant"]
    prefixes = render(tokenizer, [list(messages[:j]) for j in turns], [tools] * len(turns),
                      add_generation_prompt=True) if turns else []
    spans = []
    for j, prefix in zip(turns, prefixes):
        if not full.startswith(prefix):
            raise ValueError(
                f"chat template is not prefix-stable at assistant turn {j}: the conversation's "
                "rendering does not start with its history plus the generation prompt")
        start = len(prefix)
        anchor = full.find(messages[j].get("content") or "", start)
        anchor = start if anchor < 0 else anchor + len(messages[j].get("content") or "")
        ends = [(full.find(eos, anchor), eos) for eos in eos_strings]
        ends = [(e, eos) for e, eos in ends if e >= 0]
        if not ends:
            raise ValueError(f"assistant turn {j} has no end-of-turn token in the rendered template")
        e, eos = min(ends)
        spans.append((start, e + len(eos)))
    return full, spans


def tokenize_conversation(tokenizer, messages: Sequence[dict[str, Any]],
                          max_seq_len: int, tools: list[dict] | None = None, *,
                          all_turns: bool = False) -> Tokenized:
    """input_ids and loss_mask for one conversation whose last message is the assistant turn
    (`all_turns`: every assistant turn in the loss, `assistant_spans`)."""
    if all_turns:
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("the last message must be the assistant turn to learn from")
        full, spans = assistant_spans(tokenizer, messages, tools)
    else:
        full, start, end = render_with_span(tokenizer, messages, tools)
        spans = [(start, end)]
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), dtype=bool)
    for start, end in spans:
        mask |= _span_mask(offsets, start, end)
    n = len(ids)
    return Tokenized(input_ids=ids[:max_seq_len], loss_mask=mask[:max_seq_len],
                     num_tokens_untruncated=n)


def _offsets(tokenizer, texts: list[str]) -> list:
    """Per text, its tokens' (start, end) character offsets: the fast tokenizer's batch encode
    (Rust, all cores) when there is one, else the tokenizer's own call; the same tokens."""
    backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None and hasattr(backend, "encode_batch"):
        return [e.offsets for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]


def length_columns(tokenizer, messages_col: Sequence[str], reference_col: Sequence[str | None],
                   max_seq_len: int, *, chunk: int = 8192,
                   tools_col: Sequence[str | None] | None = None) -> dict[str, list]:
    """Token counts per prompts.parquet row, for stats and planning (batched: a chunk's chat
    templates rendered in one call, encoded in one batch, counted with numpy).

    Rows with a reference response count the whole conversation as a training sample would
    be before regeneration; rows without one count their prompt (+ generation prompt) and
    have 0 loss tokens until generation adds a response.
    """
    from itertools import chain

    from eagle_ray.data.chat import load_tools, render

    out: dict[str, list] = {"prompt_tokens": [], "num_tokens": [], "num_loss_tokens": [],
                            "truncated": []}
    for lo in range(0, len(messages_col), chunk):
        prompts = [json.loads(m) for m in messages_col[lo:lo + chunk]]
        refs = list(reference_col[lo:lo + chunk])
        n = len(prompts)
        tools = [load_tools(t) for t in tools_col[lo:lo + chunk]] if tools_col is not None else [None] * n
        texts: list[str] = [""] * n
        span = np.zeros((n, 2), np.int64)
        bare = [i for i in range(n) if refs[i] is None]
        if bare:
            rendered = render(tokenizer, [prompts[i] for i in bare], [tools[i] for i in bare],
                              add_generation_prompt=True)
            for i, text in zip(bare, rendered):
                texts[i] = text
                span[i] = len(text)
        full = [i for i in range(n) if refs[i] is not None]
        for i, (text, start, end) in zip(full, render_with_spans(
                tokenizer, [prompts[i] + [json.loads(refs[i])] for i in full], [tools[i] for i in full])):
            texts[i] = text
            span[i] = (start, end)
        offsets = _offsets(tokenizer, texts)
        lens = np.fromiter(map(len, offsets), np.int64, count=n)
        flat = np.fromiter(chain.from_iterable(chain.from_iterable(offsets)), np.int64,
                           count=2 * int(lens.sum())).reshape(-1, 2)
        row = np.repeat(np.arange(n), lens)
        pos = np.arange(len(row)) - np.repeat(np.cumsum(lens) - lens, lens)
        start, end = span[row, 0], span[row, 1]
        mask = ((flat[:, 0] >= start) & (flat[:, 1] <= end) & (flat[:, 1] > flat[:, 0])
                & (pos < max_seq_len))
        out["prompt_tokens"] += np.bincount(row, weights=flat[:, 0] < start, minlength=n).astype(int).tolist()
        out["num_tokens"] += np.minimum(lens, max_seq_len).tolist()
        out["num_loss_tokens"] += np.bincount(row, weights=mask, minlength=n).astype(int).tolist()
        out["truncated"] += (lens > max_seq_len).tolist()
    return out


def turn_lengths(tokenizer, messages_col: Sequence[str], reference_col: Sequence[str | None],
                 max_seq_len: int, tools_col: Sequence[str | None]) -> list[list[int]]:
    """Per prompts.parquet row, the training-window length of each sample that regenerating
    every assistant turn draws from it (data.train_turns=all, `data.chat.assistant_turns`):
    the logged session's tokens through each assistant turn, capped at max_seq_len, the
    logged turn standing in for the one generation will draw. A row without a logged final
    turn counts its prompt for it (as `length_columns` does)."""
    from eagle_ray.data.chat import assistant_turns, load_tools, render

    out = []
    for m, ref, tools_json in zip(messages_col, reference_col, tools_col):
        session = json.loads(m) + ([json.loads(ref)] if ref is not None else [])
        tools = load_tools(tools_json)
        turns = assistant_turns(session)
        try:
            full, spans = assistant_spans(tokenizer, session, tools)
            starts = np.asarray(_offsets(tokenizer, [full])[0], np.int64).reshape(-1, 2)[:, 0]
            ends = dict(zip([j for j, x in enumerate(session) if x.get("role") == "assistant"],
                            (e for _, e in spans)))
            lengths = [int(np.count_nonzero(starts < ends[i])) for i in turns]
            total = len(starts)
        except ValueError:  # a template that renders history differently later: each cut alone
            texts = render(tokenizer, [session[:i + 1] for i in turns] + [session], [tools] * (len(turns) + 1))
            *lengths, total = map(len, _offsets(tokenizer, texts))
        if ref is None:
            lengths.append(total)
        out.append([min(n, max_seq_len) for n in lengths])
    return out


def load_tokenizer(target):
    """The target's tokenizer (with its chat template); builds the tiny target on first use."""
    from transformers import AutoTokenizer

    from eagle_ray.targets.resolve import resolve_target_path

    tok = AutoTokenizer.from_pretrained(str(resolve_target_path(target)),
                                        revision=target.revision,
                                        trust_remote_code=target.trust_remote_code)
    # Counted, not fed to a model: a session longer than model_max_length is counted (and
    # truncated at data.max_seq_len) without transformers' warning on the console.
    tok.model_max_length = sys.maxsize
    return tok


LENGTH_TYPES = {"prompt_tokens": "int32", "num_tokens": "int32", "num_loss_tokens": "int32",
                "truncated": "bool_"}
TURNS_COLUMN = "turn_tokens"  # per row, list<int32>: `turn_lengths` (regenerating every turn)
PARALLEL_CHUNK = 8192  # rows per Ray Data batch when counting on the cluster
MIN_CLUSTER_CPUS = 4  # fewer: count in this process


class LengthUDF:
    """Ray Data actor: the target's tokenizer, loaded once; a batch of prompts.parquet rows
    (`messages`, `reference`, `tools`, `_row`) -> their token-count columns and `_row`."""

    def __init__(self, target, max_seq_len: int):
        self.tokenizer = load_tokenizer(target)
        self.max_seq_len = max_seq_len

    def __call__(self, batch):
        import pyarrow as pa

        cols = length_columns(self.tokenizer, batch.column("messages").to_pylist(),
                              batch.column("reference").to_pylist(), self.max_seq_len,
                              tools_col=batch.column("tools").to_pylist())
        return pa.table({"_row": batch.column("_row"),
                         **{k: pa.array(v, getattr(pa, LENGTH_TYPES[k])()) for k, v in cols.items()}})


def lengths_on_ray(recipe, table, workers: int):
    """`length_columns` of every row as Ray Data `map_batches` over `workers` tokenizer
    actors (the cluster's CPUs); rows come back in table order (sorted on a row number)."""
    import numpy as np
    import pyarrow as pa
    import ray

    from eagle_ray.ops.cluster import init_ray

    init_ray()
    src = table.select(["messages", "reference", "tools"]).append_column(
        "_row", pa.array(np.arange(table.num_rows, dtype=np.int64)))
    ds = ray.data.from_arrow([src.slice(i, PARALLEL_CHUNK) for i in range(0, src.num_rows, PARALLEL_CHUNK)])
    ds = ds.map_batches(LengthUDF, fn_constructor_args=(recipe.target, recipe.data.max_seq_len),
                        compute=ray.data.ActorPoolStrategy(size=workers), batch_size=None,
                        batch_format="pyarrow", num_cpus=1)
    got = pa.concat_tables(list(ds.iter_batches(batch_size=None, batch_format="pyarrow")))
    got = got.sort_by("_row")
    if got.num_rows != table.num_rows:
        raise RuntimeError(f"token counting returned {got.num_rows} rows for {table.num_rows}")
    return {k: got.column(k) for k in LENGTH_TYPES}


def token_count_workers(rows: int, requested: int | None = None) -> int:
    """How many tokenizer actors to count `rows` rows with: `requested` if given, else the
    CPUs of the Ray cluster this process is connected to, or is a job of (RAY_ADDRESS), when
    it has at least MIN_CLUSTER_CPUS; 1: count in this process. A process with no cluster counts here: starting one costs
    more than it saves on a machine of a few cores."""
    import os

    if requested is not None:
        return max(1, requested)
    if rows < 4 * PARALLEL_CHUNK:
        return 1
    import ray

    if not ray.is_initialized():
        if not os.environ.get("RAY_ADDRESS"):
            return 1
        from eagle_ray.ops.cluster import init_ray

        init_ray()
    cpus = int(ray.cluster_resources().get("CPU", 1))
    # On 2 cores the fast tokenizer's batch encode already uses both, and 2 actors were
    # slower (bench/bench_ingest_stats.py --token-workers 2: 4.4K vs 5.8K lines/s).
    return cpus if cpus >= MIN_CLUSTER_CPUS else 1


def length_annotator(recipe, *, workers: int | None = None):
    """An `ingest(annotate=...)` callback adding token-count columns with the recipe's
    tokenizer: in this process, or on `token_count_workers` Ray actors (same columns)."""
    import pyarrow as pa

    tokenizer = load_tokenizer(recipe.target)

    def annotate(table: pa.Table) -> pa.Table:
        if table.column("tools").null_count < table.num_rows:
            from eagle_ray.data.chat import check_renders_tools

            check_renders_tools(tokenizer, recipe.target.path)
        n = token_count_workers(table.num_rows, workers)
        if n > 1:
            cols = lengths_on_ray(recipe, table, n)
        else:
            cols = {k: pa.array(v, getattr(pa, LENGTH_TYPES[k])()) for k, v in length_columns(
                tokenizer, table.column("messages").to_pylist(),
                table.column("reference").to_pylist(), recipe.data.max_seq_len,
                tools_col=table.column("tools").to_pylist()).items()}
        for name, values in cols.items():
            table = table.append_column(name, values)
        if recipe.regenerates_every_turn:  # the planner counts one sample per turn (plan_from_stats)
            table = table.append_column(TURNS_COLUMN, pa.array(turn_lengths(
                tokenizer, table.column("messages").to_pylist(), table.column("reference").to_pylist(),
                recipe.data.max_seq_len, table.column("tools").to_pylist()), pa.list_(pa.int32())))
        return table

    return annotate
