"""Agent sessions as gateways export them: read with tools and calls, validated by name,
rendered as served (token for token against vLLM's own chat path), masked on tool calls."""

import json
import shutil
from pathlib import Path

import pytest

from eagle_ray.data.formats import canonical_json, parse_record
from eagle_ray.data.ingest import SourceSpec, ingest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "data" / "agentic.jsonl"


def _ingest(tmp_path, path, annotate=None):
    return ingest([SourceSpec(path=str(path))], tmp_path / "out", annotate=annotate)


def _rows(res):
    import pyarrow.parquet as pq

    return pq.read_table(res.out_dir / "prompts.parquet").to_pylist()


def test_the_example_sessions_are_accounted_for_and_each_broken_kind_named(tmp_path):
    records = [json.loads(line) for line in EXAMPLE.read_text().splitlines()]
    broken = {i + 1: r["_expect"] for i, r in enumerate(records) if "_expect" in r}
    res = _ingest(tmp_path, EXAMPLE)
    assert res.lines_read == len(records)
    assert res.accepted + res.duplicates == len(records) - len(broken)
    rejects = [json.loads(line) for line in (res.out_dir / "rejects.jsonl").read_text().splitlines()]
    # Every broken record rejected, by the name it was written to break, and nothing else.
    assert {r["line"]: r["reason"] for r in rejects} == broken
    assert set(broken.values()) >= {"bad_tools", "bad_arguments", "orphan_tool_result",
                                    "missing_tool_result", "bad_tool_call", "non_text_part"}
    # The share of sessions the text-only capture cannot train on, said once per source.
    n_img = sum(1 for r in rejects if r["reason"] == "non_text_part")
    said = [w for w in res.warnings if "non_text_part" in w]
    assert n_img and len(said) == 1 and f"{n_img:,} of its {len(records):,} sessions" in said[0]
    rows = _rows(res)
    with_tools = [r for r in rows if r["tools"] is not None]
    assert len(with_tools) == len(rows)  # every accepted session offered tools
    # Per source, in the result and the report: which kinds were rejected, how many agent
    # sessions were kept (an image session shows as its source's non_text_part).
    from collections import Counter

    report = json.loads((res.out_dir / "report.json").read_text())
    assert res.reject_reasons_per_source == report["reject_reasons_per_source"] == {
        "agentic": dict(sorted(Counter(broken.values()).items()))}
    assert res.with_tools == report["with_tools"] == {"agentic": len(rows)}
    # Tool calls and results survive, ids named, each result tied to its call.
    calls = results = 0
    for r in rows:
        msgs = json.loads(r["messages"]) + ([json.loads(r["reference"])] if r["reference"] else [])
        ids = set()
        for m in msgs:
            for c in m.get("tool_calls", ()):
                assert isinstance(json.loads(c["function"]["arguments"]), dict)
                ids.add(c["id"])
                calls += 1
            if m["role"] == "tool":
                assert m["tool_call_id"] in ids
                results += 1
    assert calls > 50 and results == calls


def test_gateway_shapes_normalise_to_template_messages():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    rec = {"tools": tools, "messages": [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "reasoning": "think",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"z": 1, "a": 2}'}},
                        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "r2"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "assistant", "content": "done"}]}
    prompt, ref, fmt, got_tools = parse_record(rec)
    assert fmt == "openai" and got_tools == tools and ref == {"role": "assistant", "content": "done"}
    assert prompt[1] == {"role": "user", "content": "a\nb"}
    call_turn = prompt[2]
    assert call_turn["content"] == "" and call_turn["reasoning_content"] == "think"
    # The logged arguments text is kept (its key order is what the template prints).
    assert [c["function"]["arguments"] for c in call_turn["tool_calls"]] == ['{"z": 1, "a": 2}', "{}"]
    assert prompt[3] == {"role": "tool", "content": "r2", "tool_call_id": "c2"}  # results may come in any order

    # The legacy functions / function_call / function role: ids named the way Kimi names them.
    legacy = {"functions": [{"name": "g"}], "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "function_call": {"name": "g", "arguments": "{}"}},
        {"role": "function", "name": "g", "content": "out"}]}
    prompt, ref, _, got_tools = parse_record(legacy)
    assert got_tools == [{"type": "function", "function": {"name": "g"}}] and ref is None
    assert prompt[1]["tool_calls"][0]["id"] == "functions.g:0"
    assert prompt[2] == {"role": "tool", "content": "out", "name": "g", "tool_call_id": "functions.g:0"}

    # glaive-style ShareGPT: the text turn and its call turn become one assistant message.
    glaive = {"tools": json.dumps([{"name": "h", "parameters": {}}]), "conversations": [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": "Let me look."},
        {"from": "function_call", "value": '{"name": "h", "arguments": {"k": "v"}}'},
        {"from": "observation", "value": "seen"}, {"from": "gpt", "value": "Found it."}]}
    prompt, ref, fmt, got_tools = parse_record(glaive)
    assert fmt == "sharegpt" and got_tools == [{"type": "function", "function": {"name": "h", "parameters": {}}}]
    assert [m["role"] for m in prompt] == ["user", "assistant", "tool"]
    assert prompt[1]["content"] == "Let me look." and prompt[1]["tool_calls"][0]["function"] == {
        "name": "h", "arguments": '{"k": "v"}'}
    assert ref == {"role": "assistant", "content": "Found it."}


def test_tools_are_part_of_the_dedupe_key_and_tool_free_ids_do_not_change(tmp_path):
    import hashlib

    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    t1 = [{"type": "function", "function": {"name": "f"}}]
    t2 = [{"type": "function", "function": {"name": "g"}}]
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in (
        {"messages": msgs}, {"messages": msgs, "tools": t1}, {"messages": msgs, "tools": t2},
        {"messages": msgs, "tools": t1})))
    res = _ingest(tmp_path, src)
    assert (res.accepted, res.duplicates) == (3, 1)
    by_line = {r["source_line"]: r for r in _rows(res)}
    # A record without tools hashes as before tools were read: its sample id is unchanged.
    old = hashlib.sha256(json.dumps({"messages": msgs[:1], "reference": msgs[1]}, sort_keys=True,
                                    ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()
    assert by_line[1]["content_hash"] == old and by_line[1]["tools"] is None
    assert by_line[2]["content_hash"] == hashlib.sha256(
        canonical_json(msgs[:1], msgs[1], t1).encode()).hexdigest()
    assert json.loads(by_line[3]["tools"]) == t2


# --------------------------------------------------------------------------- rendering


@pytest.fixture(scope="module")
def templates(tiny_target_dir, tmp_path_factory):
    """Tokenizer directories of both tiny targets (the twin's: the tiny tokenizer with the
    twin's own template, as its build writes it; its weights are not needed to render)."""
    from eagle_ray.targets.tiny.kimi import TOKENIZER_FILES, _kimi_chat_template

    kimi = tmp_path_factory.mktemp("kimi_tok")
    for name in TOKENIZER_FILES + ("config.json",):
        if (tiny_target_dir / name).exists():
            shutil.copyfile(tiny_target_dir / name, kimi / name)
    template = _kimi_chat_template()
    (kimi / "chat_template.jinja").write_text(template)
    tc = json.loads((kimi / "tokenizer_config.json").read_text())
    (kimi / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": template}))
    return {"tiny": tiny_target_dir, "kimi": kimi}


def _served_ids(model_dir, record):
    """What vLLM's chat path (the OpenAI server's renderer) makes of the logged request:
    its message parsing, then its chat-template application, tokens out."""
    from vllm.config import ModelConfig
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template
    from vllm.tokenizers import get_tokenizer

    mc = _served_ids.cache.get(str(model_dir))
    if mc is None:
        mc = _served_ids.cache[str(model_dir)] = (
            ModelConfig(model=str(model_dir), tokenizer=str(model_dir)), get_tokenizer(str(model_dir)))
    config, tok = mc
    messages = record["messages"]
    tools = record.get("tools")
    fmt = resolve_chat_template_content_format(chat_template=None, tools=tools, given_format="auto",
                                               tokenizer=tok, model_config=config)
    conversation, _, _ = parse_chat_messages(messages, config, content_format=fmt)
    return safe_apply_chat_template(config, tok, conversation, tools=tools, tokenize=True,
                                    add_generation_prompt=True)


_served_ids.cache = {}


def _request(prompt, tools):
    """The served request of a stored prompt: OpenAI messages (arguments as JSON text,
    reasoning under `reasoning`, as a client sends them)."""
    import copy

    msgs = []
    for m in copy.deepcopy(prompt):  # vLLM parses arguments in place
        if "reasoning_content" in m:
            m["reasoning"] = m.pop("reasoning_content")
        msgs.append(m)
    return {"messages": msgs, **({"tools": tools} if tools else {})}


@pytest.mark.parametrize("target", ["tiny", "kimi"])
def test_prompts_render_as_vllm_serves_them_token_for_token(templates, target):
    from transformers import AutoTokenizer

    from eagle_ray.data.chat import render

    tok = AutoTokenizer.from_pretrained(str(templates[target]))
    checked = with_calls = 0
    for line in EXAMPLE.read_text().splitlines():
        rec = json.loads(line)
        if "_expect" in rec:
            continue
        prompt, _, _, tools = parse_record(rec)
        ours = tok(render(tok, [prompt], [tools], add_generation_prompt=True)[0],
                   add_special_tokens=False)["input_ids"]
        served = _served_ids(templates[target], _request(prompt, tools))
        assert ours == served, (target, rec["messages"][:3])
        checked += 1
        if any(m["role"] == "tool" for m in prompt):
            with_calls += 1
            shown = prompt, tools
    assert checked >= 30 and with_calls >= 25
    # And the tool syntax is the target's own: Hermes tags for the tiny Llama, Kimi's
    # sections and "## Return of" results for the twin.
    prompt, tools = shown
    text = render(tok, [prompt], [tools], add_generation_prompt=True)[0]
    marks = (["<tool_call>", "<tool_response>", "# Tools"] if target == "tiny" else
             ["<|tool_calls_section_begin|>", "<|tool_call_argument_begin|>", "## Return of ",
              "<|im_start|>tool_declare\n"])
    assert all(m in text for m in marks), text


def test_a_template_that_cannot_render_tools_is_refused_by_name(tmp_path, tiny_target_dir):
    from transformers import AutoTokenizer

    from eagle_ray.data.chat import TemplateCannotRenderTools, check_renders_tools
    from eagle_ray.data.tokenize import length_columns

    tok = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    check_renders_tools(tok, "tiny")  # ours renders them
    tok.chat_template = ("{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
                         "+ '<|im_end|>\\n' }}{%- endfor -%}")  # the v1 kind: no tools, no calls
    with pytest.raises(TemplateCannotRenderTools, match=r"target my-model cannot render .*leaves out "
                                                         r"the tools, a call's name, a call's arguments"):
        check_renders_tools(tok, "my-model")
    assert length_columns  # imported: the ingest annotator runs the same check (below)


def test_ingest_with_a_recipe_refuses_tools_the_template_drops(tmp_path, monkeypatch):
    from eagle_ray.recipes import load_recipe
    from eagle_ray.data import tokenize as tk
    from eagle_ray.data.chat import TemplateCannotRenderTools

    real = tk.load_tokenizer

    def no_tools_template(target):
        tok = real(target)
        tok.chat_template = "{%- for m in messages -%}{{ m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor -%}"
        return tok

    monkeypatch.setattr(tk, "load_tokenizer", no_tools_template)
    annotate = tk.length_annotator(load_recipe("tiny_cpu"))
    with pytest.raises(TemplateCannotRenderTools, match="target tiny cannot render"):
        _ingest(tmp_path, EXAMPLE, annotate=annotate)
    assert not (tmp_path / "out" / "prompts.parquet").exists()  # refused before writing


@pytest.mark.parametrize("target", ["tiny", "kimi"])
def test_a_final_tool_call_turn_is_masked_with_its_calls(templates, target):
    """Keep-logged on a session whose logged answer is a call: the loss covers the call's
    text and the end-of-turn token, nothing of the history or the scaffolding."""
    from transformers import AutoTokenizer

    from eagle_ray.data.chat import render
    from eagle_ray.data.tokenize import tokenize_conversation

    tok = AutoTokenizer.from_pretrained(str(templates[target]))
    tools = [{"type": "function", "function": {"name": "find_animals", "parameters": {}}}]
    msgs = [{"role": "user", "content": "Which animals live in the lake?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "functions.find_animals:0", "type": "function",
                 "function": {"name": "find_animals", "arguments": '{"place": "lake"}'}}]}]
    t = tokenize_conversation(tok, msgs, 512, tools)
    masked = tok.decode(t.input_ids[t.loss_mask])
    prefix = render(tok, [msgs[:-1]], [tools], add_generation_prompt=True)[0]
    full = render(tok, [msgs], [tools])[0]
    assert full.startswith(prefix)
    # Exactly the generated part: the turn after the generation prompt, up to its end token.
    assert masked == full[len(prefix):].rstrip("\n")
    assert masked.startswith("Let me look.") and masked.endswith("<|im_end|>")
    assert '"place": "lake"' in masked and "find_animals" in masked


@pytest.mark.parametrize("target", ["tiny", "kimi"])
def test_train_turns_all_masks_exactly_every_assistant_turn(templates, target):
    """data.train_turns=all (keep-logged): the loss covers every assistant turn of the session
    (text and calls, as rendered in the history) and nothing else. Oracle: the rendered
    ChatML text cut at its assistant headers, each body up to and with its <|im_end|>."""
    from transformers import AutoTokenizer

    from eagle_ray.data.chat import render
    from eagle_ray.data.tokenize import tokenize_conversation

    tok = AutoTokenizer.from_pretrained(str(templates[target]))
    sessions = [json.loads(line) for line in EXAMPLE.read_text().splitlines()]
    rec = next(r for r in sessions if "_expect" not in r and len(r.get("messages", ())) > 12)
    prompt, ref, _, tools = parse_record(rec)
    msgs = prompt + [ref]
    t = tokenize_conversation(tok, msgs, 1 << 20, tools, all_turns=True)
    # The masked tokens, as runs of consecutive positions.
    runs, cur = [], []
    for i, m in enumerate(t.loss_mask):
        if m:
            cur.append(int(t.input_ids[i]))
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    full = render(tok, [msgs], [tools])[0]
    header = "<|im_start|>assistant\n"
    bodies = [part[:part.index("<|im_end|>") + len("<|im_end|>")] for part in full.split(header)[1:]]
    assistants = [m for m in msgs if m["role"] == "assistant"]
    assert len(bodies) == len(assistants) >= 6
    assert runs == bodies
    for body, m in zip(bodies, assistants):
        assert m["content"] in body
        for c in m.get("tool_calls", ()):
            assert c["function"]["name"] in body or c["id"] in body
    # train_turns=last on the same session: only the final turn.
    last = tokenize_conversation(tok, msgs, 1 << 20, tools)
    assert tok.decode(t.input_ids[last.loss_mask]) == bodies[-1]
    assert (last.input_ids == t.input_ids).all()


def test_train_turns_all_with_either_mode():
    from eagle_ray.recipes import load_recipe

    assert load_recipe("tiny_cpu", ["data.train_turns=all", "generate.mode=keep_logged"]).data.train_turns == "all"
    assert load_recipe("tiny_cpu", ["data.train_turns=all"]).generate.mode == "regenerate"
    with pytest.raises(ValueError, match="choose last or all"):
        load_recipe("tiny_cpu", ["data.train_turns=some"])


def test_a_completion_mask_reaches_the_training_window():
    import pyarrow as pa

    from eagle_ray.extract.stage import MASK_COLUMN, Windows, window, with_mask_column

    ids, mask, n = window([1, 2], [3, 4, 5, 6], 5, [True, False, True, True])
    assert ids.tolist() == [1, 2, 3, 4, 5] and mask.tolist() == [False, False, True, False, True] and n == 6
    assert window([1, 2], [3, 4], 8)[1].tolist() == [False, False, True, True]  # null: all
    with pytest.raises(ValueError, match="2 entries for 3 completion tokens"):
        window([1], [2, 3, 4], 8, [True, False])
    t = pa.table({"sample_id": ["a", "b"], "prompt_token_ids": [[1], [1, 2]],
                  "completion_token_ids": [[2, 3, 4], [3]]})
    w = Windows(with_mask_column(t), 8)
    assert w["a"][1] == [False, True, True, True] and w["b"][1] == [False, False, True]
    t = t.append_column(MASK_COLUMN, pa.array([[True, False, True], None], pa.list_(pa.bool_())))
    w = Windows(t, 3)
    assert w["a"] == ([1, 2, 3], [False, True, False], 4) and w["b"][1] == [False, False, True]


def test_a_window_longer_than_the_capture_engine_is_refused_before_work(tmp_path):
    """Found on the agent sessions: max_seq_len = max_model_len failed inside vLLM mid-run."""
    from eagle_ray.extract.run import check_target_shape
    from eagle_ray.recipes import load_recipe

    check_target_shape(load_recipe("tiny_cpu", ["data.max_seq_len=1023"]), tmp_path)  # fits
    with pytest.raises(ValueError, match=r"data.max_seq_len=1024 does not fit .*engine.max_model_len=1024"):
        check_target_shape(load_recipe("tiny_cpu", ["data.max_seq_len=1024"]), tmp_path)
    check_target_shape(load_recipe("tiny_cpu", ["data.max_seq_len=1024", "extract.backend=hf"]), tmp_path)


@pytest.mark.parametrize("target,parser", [("tiny", "hermes"), ("kimi", "kimi_k2")])
def test_tool_call_tokens_are_exactly_the_calls_the_template_wrote(templates, target, parser):
    """evaluate's per-turn-kind split (acceptance.tool_call_tokens): on a whole rendered
    session, the tokens it marks decode to exactly the template's tool-call sections, one
    per assistant turn with calls, each holding its calls' names and arguments."""
    import re

    from transformers import AutoTokenizer

    from eagle_ray.data.chat import render
    from eagle_ray.evaluate.acceptance import TOOL_CALL_MARKERS, tool_call_tokens

    tok = AutoTokenizer.from_pretrained(str(templates[target]))
    begin, end = TOOL_CALL_MARKERS[parser]
    sessions = [json.loads(line) for line in EXAMPLE.read_text().splitlines()]
    rec = next(r for r in sessions if "_expect" not in r and len(r.get("messages", ())) > 12)
    prompt, ref, _, tools = parse_record(rec)
    msgs = prompt + [ref]
    text = render(tok, [msgs], [tools])[0]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    mask = tool_call_tokens(tok, ids, (begin, end))
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    # In the rendered text, the sections after the system prompt's tool list (a Hermes
    # system prompt may name the markers when it explains them).
    sections = re.findall(re.escape(begin) + ".*?" + re.escape(end), text, flags=re.S)
    with_calls = [m for m in msgs if m["role"] == "assistant" and m.get("tool_calls")]
    assert runs == sections and len(runs) >= len(with_calls) >= 3
    # Each call's name (Hermes) or id (Kimi writes `functions.NAME:IDX` ids) is in a section.
    calls = [c for m in with_calls for c in m["tool_calls"]]
    assert all(any(c["function"]["name"] in r or c["id"] in r for r in runs) for c in calls)


@pytest.mark.parametrize("target", ["tiny", "kimi"])
def test_a_long_session_loses_its_oldest_turns_not_its_last(templates, target):
    """data.long_sessions=cut_history (generate/stage.fit_session): a session longer than the
    window keeps its system prompt, tools, first user message and final turn with what it
    answers, drops whole units of history oldest first (a call never without its result),
    as few as fit; truncate_end leaves it to end-truncation, as before."""
    import dataclasses

    from transformers import AutoTokenizer

    from eagle_ray.data.chat import render
    from eagle_ray.generate.stage import fit_session
    from eagle_ray.recipes import load_recipe

    tok = AutoTokenizer.from_pretrained(str(templates[target]))
    sessions = [json.loads(line) for line in EXAMPLE.read_text().splitlines()]
    rec = next(r for r in sessions if "_expect" not in r and len(r.get("messages", ())) > 12)
    prompt, ref, _, tools = parse_record(rec)
    msgs = prompt + [ref]

    def n(m, gen=False):
        return len(tok(render(tok, [m], [tools], add_generation_prompt=gen)[0],
                       add_special_tokens=False)["input_ids"])

    full = n(msgs)
    # The window: room for the system prompt with its tools, the first question, the last
    # call with its results and the answer (~850 tokens here), not for the whole (~1,200).
    w = 960
    recipe = load_recipe("tiny_cpu", [f"data.max_seq_len={w}", "engine.max_model_len=2048"])
    assert full > w
    cut, dropped = fit_session(tok, recipe, msgs, tools, full, prompt=False)
    assert 0 < dropped == full - n(cut) and n(cut) <= w
    assert cut[0] == msgs[0] and cut[0]["role"] == "system" and cut[1] == msgs[1]
    assert cut[-1] == msgs[-1] and cut[-2] == msgs[-2]  # the answer and what it answers
    kept = cut[2:]
    assert kept == msgs[len(msgs) - len(kept):]  # a suffix: the oldest went first
    for i, m in enumerate(cut):  # every tool result follows its call's turn
        if m["role"] == "tool":
            assert any(p["role"] == "assistant" and p.get("tool_calls") for p in cut[:i])
            assert cut[i - 1]["role"] in ("assistant", "tool")
    assert kept[0]["role"] != "tool"
    # As few dropped as fit: putting back the newest dropped unit overflows.
    from eagle_ray.data.chat import history_units

    head, units = history_units(msgs, len(msgs) - 1)
    first_kept = len(msgs) - len(kept)
    d = [u[0] for u in units].index(first_kept)
    assert head == 2 and d > 0 and n(msgs[:head] + msgs[units[d - 1][0]:]) > w
    # A prompt (regenerate) keeps room to generate: generate.max_tokens (128, < w / 4).
    p_cut, p_dropped = fit_session(tok, recipe, prompt, tools, n(prompt, gen=True), prompt=True)
    assert p_dropped > 0 and n(p_cut, gen=True) <= w - 128 and p_cut[-1] == prompt[-1]
    old = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, long_sessions="truncate_end"))
    assert fit_session(tok, old, msgs, tools, full, prompt=False) == (msgs, 0)


@pytest.mark.parametrize("target,parser,text,call_id", [
    ("tiny", "hermes", 'Let me look.\n<tool_call>\n{"name": "find_animals", "arguments": '
     '{"place": "lake"}}\n</tool_call>', "functions.find_animals:0"),
    ("kimi", "kimi_k2", "Let me look.<|tool_calls_section_begin|><|tool_call_begin|>"
     'functions.find_animals:0<|tool_call_argument_begin|>{"place": "lake"}<|tool_call_end|>'
     "<|tool_calls_section_end|>", "functions.find_animals:0")])
def test_generated_calls_are_parsed_back_with_the_targets_vllm_parser(templates, target, parser,
                                                                     text, call_id):
    """A regenerated turn's calls, split from its text by vLLM's own tool parser (the
    recipe's serve.tool_call_parser) into the conversations table, ids stable across runs."""
    from transformers import AutoTokenizer

    from eagle_ray.generate.stage import parse_tool_calls

    tok = AutoTokenizer.from_pretrained(str(templates[target]))
    tools = [{"type": "function", "function": {"name": "find_animals", "parameters": {
        "type": "object", "properties": {"place": {"type": "string"}}}}}]
    content, calls = parse_tool_calls(parser, tok, tools, text)
    assert content.strip() == "Let me look."
    assert calls == [{"id": call_id, "type": "function",
                      "function": {"name": "find_animals", "arguments": '{"place": "lake"}'}}]
    assert parse_tool_calls(parser, tok, tools, "No call here.") == ("No call here.", None)


def test_every_turn_regenerated_expands_a_session_into_its_logged_histories(tmp_path, tiny_tokenizer):
    """data.train_turns=all with regeneration: one request per logged assistant turn, each
    from the history that turn answered (ending in the user message or tool results before
    it), plus the end of the session; ids `<prompt>#<t * N + j>`; and ingest's per-turn
    lengths, which the plan counts, have one entry per request."""
    import pyarrow as pa

    from eagle_ray.data.chat import assistant_turns
    from eagle_ray.data.ids import prompt_id, turn_index
    from eagle_ray.data.tokenize import length_annotator
    from eagle_ray.generate.stage import Regenerate
    from eagle_ray.plan.budget import plan_for_table
    from eagle_ray.recipes import load_recipe

    recipe = load_recipe("tiny_cpu", ["data.train_turns=all", "generate.samples_per_prompt=2",
                                      "data.max_seq_len=1000"])
    res = _ingest(tmp_path, EXAMPLE, annotate=length_annotator(recipe))
    table = pa.Table.from_pylist(_rows(res))
    udf = Regenerate.__new__(Regenerate)
    udf.recipe = recipe
    out = udf._expand(table.select(["sample_id", "source", "messages", "reference", "tools"]))
    by_prompt: dict[str, list] = {}
    for r in out.to_pylist():
        by_prompt.setdefault(prompt_id(r["sample_id"]), []).append(r)
    for row in table.to_pylist():
        session = json.loads(row["messages"])
        starts = assistant_turns(session)
        got = by_prompt[row["sample_id"]]
        assert len(got) == 2 * (len(starts) + 1) == 2 * len(row["turn_tokens"])
        assert [turn_index(r["sample_id"], 2) for r in got] == [t for t in range(len(starts) + 1) for _ in (0, 1)]
        for t, end in enumerate(starts + [len(session)]):
            for r in got[2 * t:2 * t + 2]:
                assert json.loads(r["messages"]) == session[:end]
                assert json.loads(r["messages"])[-1]["role"] in ("user", "tool", "function")
                assert r["tools"] == row["tools"] and r["source"] == row["source"]
        # the lengths grow turn by turn and end where the logged final turn ends
        assert row["turn_tokens"] == sorted(row["turn_tokens"])
        if not row["truncated"]:
            assert row["turn_tokens"][-1] == row["prompt_tokens"] + row["num_loss_tokens"]
    assert len(by_prompt) == table.num_rows
    _, plan = plan_for_table(recipe, res.out_dir, out_dir=tmp_path)
    assert plan.num_samples == out.num_rows and plan.turns_of == table.num_rows
    # what the plan does not train on: the example's image sessions, its share named
    report = json.loads((res.out_dir / "report.json").read_text())
    assert plan.non_text_share == report["non_text_share"] and set(plan.non_text_share) == {"agentic"}
    from eagle_ray.plan.budget import format_plan

    assert f"agentic: {report['non_text_share']['agentic']:.1%} of its sessions" in format_plan(plan)
    from eagle_ray.generate.run import expected_samples  # the streamed run's progress total

    assert expected_samples(recipe, res.out_dir / "prompts.parquet") == out.num_rows
    assert plan.total_tokens == 2 * sum(sum(r["turn_tokens"]) for r in table.to_pylist())
    # ingested for the final turn only: the plan for every turn refuses, naming the fix
    res_last = ingest([SourceSpec(path=str(EXAMPLE))], tmp_path / "last",
                      annotate=length_annotator(load_recipe("tiny_cpu", [])))
    with pytest.raises(ValueError, match="ingest again"):
        plan_for_table(recipe, res_last.out_dir, out_dir=tmp_path)
