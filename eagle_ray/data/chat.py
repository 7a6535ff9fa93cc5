"""Stored conversations -> chat-template input, exactly as vLLM's chat path hands a request over.

Every place that renders a prompt (generation, keep-logged tokenization, token counts,
evaluation) goes through `render`, so the prompt token ids a drafter trains on equal what
`vllm serve` renders for the same request (a test compares them token for token):

* the request's ``tools`` go to the template as ``tools=`` (a list of function specs, in the
  key order logged: templates print them);
* a call's ``arguments``, stored as the logged JSON text, reaches the template as an object
  (vLLM parses it so; transformers' tool-use templates expect a mapping);
* reasoning is stored as ``reasoning_content``; vLLM gives templates the same text under
  both ``reasoning`` and ``reasoning_content``, and so does `template_messages`.

`check_renders_tools` refuses, before any work starts, a target whose template would drop
the tools or the calls of a conversation (the prompt would differ from the served one).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from eagle_ray.common.errors import UserFault


class TemplateCannotRenderTools(UserFault, ValueError):
    """The target's chat template drops the tools or calls of a session that has them."""


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored messages as the chat template receives them (new dicts; input untouched)."""
    out = []
    for m in messages:
        if "tool_calls" in m or "reasoning_content" in m:
            m = dict(m)
            if "reasoning_content" in m:
                m["reasoning"] = m["reasoning_content"]
            if "tool_calls" in m:
                m["tool_calls"] = [
                    {**c, "function": {**c["function"],
                                       "arguments": json.loads(c["function"]["arguments"] or "{}")}}
                    for c in m["tool_calls"]]
        out.append(m)
    return out


def load_tools(tools_json: str | None) -> list[dict] | None:
    return None if tools_json is None else json.loads(tools_json)


def render(tokenizer, conversations: Sequence[Sequence[dict[str, Any]]],
           tools: Sequence[list[dict] | None] | None = None, **kwargs) -> list[str]:
    """Chat-template text of each conversation with its tools (None: no tools); rows
    without tools are rendered in one batched template call, as before tools existed."""
    n = len(conversations)
    tools = list(tools) if tools is not None else [None] * n
    if len(tools) != n:
        raise ValueError(f"{n} conversations but {len(tools)} tool lists")
    out: list[str] = [""] * n
    bare = [i for i in range(n) if not tools[i]]
    if bare:
        texts = tokenizer.apply_chat_template([template_messages(conversations[i]) for i in bare],
                                              tokenize=False, **kwargs)
        for i, t in zip(bare, texts):
            out[i] = t
    for i in range(n):
        if tools[i]:
            out[i] = tokenizer.apply_chat_template(template_messages(conversations[i]),
                                                   tools=tools[i], tokenize=False, **kwargs)
    return out


_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool_q7", "description": "d",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
_PROBE = [
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.probe_call_z3:0", "type": "function",
         "function": {"name": "probe_call_z3", "arguments": '{"x": "arg_v9"}'}}]},
    {"role": "tool", "tool_call_id": "functions.probe_call_z3:0", "content": "result_k4"},
]


def assistant_turns(messages: Sequence[dict[str, Any]]) -> list[int]:
    """Where each logged assistant turn of a session starts: the index of an assistant message
    that follows a non-assistant one (a user message or tool results), so `messages[:i]` is
    the history that turn answered. Regenerating every turn (data.train_turns=all) draws one
    sample per start, plus one for the end of the session (the turn the log leaves open)."""
    return [i for i, m in enumerate(messages)
            if m.get("role") == "assistant" and i > 0 and messages[i - 1].get("role") != "assistant"]


def history_units(messages: Sequence[dict[str, Any]], tail_from: int) -> tuple[int, list[tuple[int, int]]]:
    """(head, units): messages[:head] are always kept (leading system messages and the first
    user message); `units` are the [start, end) runs of messages[head:tail_from] that can be
    dropped whole: a user message, or an assistant message with the tool results after it
    (so a call never loses its result, nor a result its call)."""
    head = 0
    while head < len(messages) and messages[head].get("role") == "system":
        head += 1
    if head < len(messages) and messages[head].get("role") == "user":
        head += 1
    units, i = [], head
    while i < tail_from:
        j = i + 1
        if messages[i].get("role") == "assistant":
            while j < tail_from and messages[j].get("role") in ("tool", "function"):
                j += 1
        units.append((i, j))
        i = j
    return head, units


def cut_history(count_tokens, messages: list[dict[str, Any]], tail_from: int,
                budget: int) -> tuple[list[dict[str, Any]], int]:
    """The session with the fewest oldest history units dropped (`history_units`) whose
    `count_tokens(messages)` is at most `budget`, and how many messages were dropped. Keeps
    messages[tail_from:] (the turn learned from, and for a prompt the unit it answers). If
    no cut fits, the session unchanged (the caller truncates or refuses it as before: a cut
    that cannot save the final turn only loses earlier ones). Binary search: lengths shrink
    as units are dropped."""
    if count_tokens(messages) <= budget:
        return messages, 0
    head, units = history_units(messages, tail_from)
    if not units:
        return messages, 0

    def cut(d: int) -> list[dict[str, Any]]:
        start = units[d][0] if d < len(units) else tail_from
        return messages[:head] + messages[start:]

    lo, hi = 1, len(units)  # the smallest d that fits, or len(units)
    while lo < hi:
        mid = (lo + hi) // 2
        if count_tokens(cut(mid)) <= budget:
            hi = mid
        else:
            lo = mid + 1
    out = cut(lo)
    if count_tokens(out) > budget:
        return messages, 0
    return out, len(messages) - len(out)


def template_problem(tokenizer) -> str | None:
    """Why the tokenizer's chat template cannot render an agent session as served, or None:
    the tool specs, a call's name and arguments, and a tool result must all appear."""
    try:
        text = render(tokenizer, [_PROBE], [[_PROBE_TOOL]], add_generation_prompt=True)[0]
    except Exception as e:  # a template that raises on tools or tool roles
        return f"rendering a session with tools raised {type(e).__name__}: {str(e)[:200]}"
    missing = [what for what, s in (("the tools", "probe_tool_q7"), ("a call's name", "probe_call_z3"),
                                    ("a call's arguments", "arg_v9"), ("a tool result", "result_k4"))
               if s not in text]
    return f"its output leaves out {', '.join(missing)}" if missing else None


def check_renders_tools(tokenizer, target: str) -> None:
    """Raise TemplateCannotRenderTools when the template would drop tools or calls."""
    problem = template_problem(tokenizer)
    if problem is not None:
        raise TemplateCannotRenderTools(
            f"the chat template of target {target} cannot render sessions with tools ({problem}); "
            "the prompts have tools, so they would be trained on differently from how they are "
            "served: use a target whose template renders tools and tool calls, or drop the "
            "sources with tools")
