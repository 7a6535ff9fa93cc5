"""Per-line conversation formats: one parsed JSON value -> canonical (prompt, reference, tools).

Accepted line formats (one JSON object per line; other top-level keys are ignored):

* OpenAI chat completions, as gateways export a request and its answer:
  ``{"messages": [...], "tools": [...]}``. Roles system / developer (-> system), user,
  assistant, tool, and the legacy function role (-> tool). ``content`` is a string or a
  list of text parts, joined with "\\n" as vLLM's chat path joins them; an assistant turn
  may carry ``tool_calls`` (or the legacy ``function_call``) with null or empty content,
  and reasoning as ``reasoning_content`` or ``reasoning`` (null or blank counts as
  absent). ``tools`` is a list of function specs (``{"type": "function", "function":
  {"name": ...}}``); the legacy ``functions`` (bare specs) are wrapped the same way.
* ShareGPT: ``{"conversations": [{"from": ..., "value": ...}, ...]}``, roles matched
  case-insensitively (human/user, gpt/assistant/chatgpt, system), and the tool variants
  glaive-style sets ship: ``function_call`` turns (value: JSON ``{"name", "arguments"}``),
  ``observation`` turns (the result) and a top-level ``tools`` list or JSON string.
* Plain:    ``{"prompt": ..., "response"|"completion": ...}``

When several keys are present the first of ``messages``, ``conversations``, ``prompt``
wins. Everything normalises to the messages a chat template receives:

* ``{"role": "system" | "user", "content": str}``
* ``{"role": "assistant", "content": str[, "reasoning_content": str][, "tool_calls": [
  {"id": str, "type": "function", "function": {"name": str, "arguments": str}}]]}`` --
  ``arguments`` stays the logged JSON text (a JSON object; key order is the model's own
  and a template prints it), turned into an object only when rendered (data/chat.py);
  a call without an id gets Kimi's ``functions.NAME:IDX`` (IDX: the call's index in the
  session)
* ``{"role": "tool", "content": str, "tool_call_id": str[, "name": str]}``

Session rules: an optional system message, then a user turn; a user turn is answered by an
assistant turn; an assistant turn with calls gets every call's result (a tool message
answering it: by id where the result names one, else the oldest open call) before the next
user or assistant turn; an assistant turn without calls is followed by a user turn. The
prompt runs up to the last user or tool message; an assistant message after it is the
reference (the turn regenerated or learned from).

A line that does not fit raises ``Reject`` with a stable reason code (see validate.py
for the full list).
"""

from __future__ import annotations

import json
from typing import Any


class Reject(Exception):
    """A line failed validation; ``code`` is the stable reason code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_ROLE_OPENAI = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                "tool": "tool", "function": "tool"}
_ROLE_SHAREGPT = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}


def type_name(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 40 else r[:37] + "..."


def _blank(s: str) -> bool:
    # isspace() stops at the first non-space char; strip() would copy the whole string.
    return not s or s.isspace()


def _join_parts(content: Any, where: str) -> str:
    """A list of text parts -> one string, joined with "\n" (vLLM's chat path joins a
    message's text parts so, so the prompt trained on is the prompt served)."""
    if type(content) is not list:
        raise Reject(
            "bad_type", f"{where}.content must be a string or a list of text parts, got {type_name(content)}"
        )
    texts = []
    for j, part in enumerate(content):
        if type(part) is not dict:
            raise Reject("bad_type", f"{where}.content[{j}] must be an object, got {type_name(part)}")
        ptype = part.get("type")
        if ptype != "text":
            raise Reject(
                "non_text_part",
                f"{where}.content[{j}] has type {_short(ptype)}; only text parts are supported",
            )
        text = part.get("text")
        if type(text) is not str:
            raise Reject("bad_type", f"{where}.content[{j}].text must be a string, got {type_name(text)}")
        texts.append(text)
    return "\n".join(texts)


def _text(content: Any, where: str) -> str:
    return content if type(content) is str else _join_parts(content, where)


def _arguments(args: Any, where: str) -> str:
    """A call's arguments as JSON text of an object (the logged text kept as it is)."""
    if args is None or args == "":
        return "{}"  # vLLM renders a missing or empty arguments string as {}
    if type(args) is dict:
        return json.dumps(args, ensure_ascii=False)
    if type(args) is not str:
        raise Reject("bad_arguments", f"{where}.arguments must be a JSON string or an object, "
                                      f"got {type_name(args)}")
    try:
        parsed = json.loads(args)
    except (ValueError, RecursionError) as e:
        raise Reject("bad_arguments", f"{where}.arguments is not JSON: {str(e)[:80]}") from None
    if type(parsed) is not dict:
        raise Reject("bad_arguments", f"{where}.arguments must be a JSON object, got {type_name(parsed)}")
    return args


def _call(name: Any, args: Any, call_id: Any, where: str) -> dict:
    if type(name) is not str or _blank(name):
        raise Reject("bad_tool_call", f"{where}.name must be a non-empty string, got {_short(name)}")
    if call_id is not None and (type(call_id) is not str or _blank(call_id)):
        raise Reject("bad_tool_call", f"{where} id must be a non-empty string, got {_short(call_id)}")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": _arguments(args, where)}}


def _function_of(item: Any, where: str, code: str) -> dict:
    """The "function" object of a {"type": "function", "function": {...}} entry (a call or
    a tool spec)."""
    if type(item) is not dict:
        raise Reject(code, f"{where} must be an object, got {type_name(item)}")
    if item.get("type", "function") != "function":
        raise Reject(code, f"{where}.type {_short(item.get('type'))} is not \"function\"")
    fn = item.get("function")
    if type(fn) is not dict:
        raise Reject(code, f"{where}.function must be an object, got {type_name(fn)}")
    return fn


def _tool_calls(m: dict, where: str) -> list[dict]:
    """An assistant message's calls (tool_calls, or the legacy function_call); ids None
    where the log has none (named later, in session order)."""
    calls = m.get("tool_calls")
    legacy = m.get("function_call")
    out = []
    if calls is not None:
        if type(calls) is not list:
            raise Reject("bad_tool_call", f"{where}.tool_calls must be a list, got {type_name(calls)}")
        for j, c in enumerate(calls):
            w = f"{where}.tool_calls[{j}]"
            fn = _function_of(c, w, "bad_tool_call")
            out.append(_call(fn.get("name"), fn.get("arguments"), c.get("id"), f"{w}.function"))
    if legacy is not None:
        if type(legacy) is not dict:
            raise Reject("bad_tool_call", f"{where}.function_call must be an object, got {type_name(legacy)}")
        out.append(_call(legacy.get("name"), legacy.get("arguments"), None, f"{where}.function_call"))
    return out


def _reasoning(m: dict, where: str, role: str) -> str | None:
    for key in ("reasoning_content", "reasoning"):
        rc = m.get(key)
        if rc is None:  # null is common in exported logs; treat it as absent
            continue
        if type(rc) is not str:
            raise Reject("bad_type", f"{where}.{key} must be a string, got {type_name(rc)}")
        if _blank(rc):
            continue
        if role != "assistant":
            raise Reject("bad_type", f"{where} ({role}) has {key}; only assistant messages may")
        return rc
    return None


def _from_openai(raw: Any) -> list[dict]:
    if type(raw) is not list:
        raise Reject("bad_type", f'"messages" must be a list, got {type_name(raw)}')
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if type(m) is not dict:
            raise Reject("bad_type", f"{where} must be an object, got {type_name(m)}")
        role = m.get("role")
        if type(role) is not str:
            raise Reject("bad_type", f"{where}.role must be a string, got {type_name(role)}")
        r = _ROLE_OPENAI.get(role)
        if r is None:
            raise Reject(
                "unknown_role",
                f"{where}.role {_short(role)} is not one of system, developer, user, assistant, "
                "tool, function",
            )
        content = m.get("content")
        calls = _tool_calls(m, where) if r == "assistant" else []
        if content is None and (calls or r == "tool"):
            content = ""  # a call turn's content is often null; so is an empty tool result
        content = _text(content, where)
        if _blank(content) and not calls and r != "tool":
            raise Reject("empty_content", f"{where} ({r}) has empty content")
        msg: dict[str, Any] = {"role": r, "content": content}
        rc = _reasoning(m, where, r)
        if rc is not None:
            msg["reasoning_content"] = rc
        if calls:
            msg["tool_calls"] = calls
        if r == "tool":
            for key in ("tool_call_id", "name"):
                v = m.get(key)
                if v is not None and (type(v) is not str or _blank(v)):
                    raise Reject("bad_type", f"{where}.{key} must be a non-empty string, got {_short(v)}")
                if v is not None:
                    msg[key] = v
        out.append(msg)
    return out


def _sharegpt_call(value: str, where: str) -> dict:
    try:
        obj = json.loads(value)
    except (ValueError, RecursionError):
        raise Reject("bad_tool_call", f'{where}.value of a function_call turn must be JSON '
                                      '{"name": ..., "arguments": ...}') from None
    if type(obj) is not dict:
        raise Reject("bad_tool_call", f"{where}.value of a function_call turn must be a JSON object, "
                                      f"got {type_name(obj)}")
    return _call(obj.get("name"), obj.get("arguments"), None, where)


def _from_sharegpt(raw: Any) -> list[dict]:
    if type(raw) is not list:
        raise Reject("bad_type", f'"conversations" must be a list, got {type_name(raw)}')
    out = []
    for i, t in enumerate(raw):
        where = f"conversations[{i}]"
        if type(t) is not dict:
            raise Reject("bad_type", f"{where} must be an object, got {type_name(t)}")
        frm = t.get("from")
        if type(frm) is not str:
            raise Reject("bad_type", f'{where}["from"] must be a string, got {type_name(frm)}')
        low = frm.lower()
        r = _ROLE_SHAREGPT.get(frm) or _ROLE_SHAREGPT.get(low)
        if r is None:
            raise Reject(
                "unknown_role",
                f'{where}["from"] {_short(frm)} is not one of human, user, gpt, '
                "assistant, chatgpt, system, function_call, observation, tool",
            )
        value = t.get("value")
        if type(value) is not str:
            raise Reject("bad_type", f"{where}.value must be a string, got {type_name(value)}")
        if low == "function_call":
            out.append({"role": "assistant", "content": "", "tool_calls": [_sharegpt_call(value, where)]})
            continue
        if _blank(value) and r != "tool":
            raise Reject("empty_content", f"{where} ({r}) has empty value")
        out.append({"role": r, "content": value})
    return out


def _merge_call_turns(msgs: list[dict]) -> list[dict]:
    """ShareGPT writes an answer's text and its call as two turns (gpt, then function_call);
    OpenAI (and every template) has them as one assistant message."""
    out: list[dict] = []
    for m in msgs:
        prev = out[-1] if out else None
        if (prev is not None and m["role"] == "assistant" and prev["role"] == "assistant"
                and "tool_calls" in m and "tool_calls" not in prev and not m["content"]):
            out[-1] = {**prev, "tool_calls": m["tool_calls"]}
        else:
            out.append(m)
    return out


def _from_plain(obj: dict) -> list[dict[str, str]]:
    prompt = obj["prompt"]
    if type(prompt) is not str:
        raise Reject("bad_type", f'"prompt" must be a string, got {type_name(prompt)}')
    if _blank(prompt):
        raise Reject("empty_content", '"prompt" is empty')
    out = [{"role": "user", "content": prompt}]
    key = "response"
    resp = obj.get(key)
    if resp is None:
        key = "completion"
        resp = obj.get(key)
    if resp is not None:
        if type(resp) is not str:
            raise Reject("bad_type", f'"{key}" must be a string, got {type_name(resp)}')
        if _blank(resp):
            raise Reject("empty_content", f'"{key}" is empty')
        out.append({"role": "assistant", "content": resp})
    return out


def _tools(obj: dict) -> list[dict] | None:
    """The record's tool specs as {"type": "function", "function": {...}} (None: no tools)."""
    specs: list[dict] = []
    for key in ("tools", "functions"):
        raw = obj.get(key)
        if raw is None:
            continue
        if type(raw) is str:  # glaive-style ShareGPT ships them as a JSON string
            try:
                raw = json.loads(raw) if not _blank(raw) else []
            except (ValueError, RecursionError):
                raise Reject("bad_tools", f'"{key}" is a string that is not a JSON list of function specs') from None
        if type(raw) is not list:
            raise Reject("bad_tools", f'"{key}" must be a list of function specs, got {type_name(raw)}')
        for j, spec in enumerate(raw):
            where = f"{key}[{j}]"
            if type(spec) is dict and "function" not in spec and "type" not in spec:
                fn = spec  # a bare spec: legacy "functions", glaive-style "tools"
            else:  # {"type": "function", "function": {...}}
                fn = _function_of(spec, where, "bad_tools")
            name = fn.get("name")
            if type(name) is not str or _blank(name):
                raise Reject("bad_tools", f"{where} has no function name")
            specs.append({"type": "function", "function": fn})
    return specs or None


def _name_calls(msgs: list[dict]) -> None:
    """Give every call an id (Kimi's functions.NAME:IDX where the log has none) and every
    tool result the id of the call it answers; check the session's turn order."""
    n = len(msgs)
    if n == 0:
        raise Reject("no_user_turn", "conversation has no messages")
    if not any(m["role"] == "user" for m in msgs):
        raise Reject("no_user_turn", "conversation has no user message")
    start = 1 if msgs[0]["role"] == "system" else 0
    expect = ("user",)
    open_calls: list[dict] = []  # calls of the last assistant turn still without a result
    k = 0  # calls so far in the session
    for i in range(start, n):
        m = msgs[i]
        r = m["role"]
        if r == "system":
            raise Reject("bad_order", f"system message at position {i}; only one is allowed, at position 0")
        if r == "tool":
            if not open_calls:
                raise Reject("orphan_tool_result", f"message {i} is a tool result but no call of this "
                                                   "session is waiting for one")
            want = m.get("tool_call_id")
            hit = next((c for c in open_calls if c["id"] == want), None) if want else open_calls[0]
            if hit is None:
                ids = ", ".join(c["id"] for c in open_calls)
                raise Reject("orphan_tool_result", f"message {i} answers call id {_short(want)}, "
                                                   f"which no open call has (open: {ids})")
            open_calls.remove(hit)
            m["tool_call_id"] = hit["id"]
            expect = ("tool",) if open_calls else ("assistant", "user")
            continue
        if open_calls:
            ids = ", ".join(c["id"] for c in open_calls)
            raise Reject("missing_tool_result", f"message {i} ({r}) comes before the result of "
                                                f"call(s) {ids}")
        if r not in expect:
            raise Reject(
                "bad_order",
                f"message {i} is {r} but {' or '.join(expect)} was expected "
                "(after an optional system message, a user turn; each user turn answered by "
                "the assistant; each call answered by a tool result)",
            )
        if r == "user":
            expect = ("assistant",)
            continue
        for c in m.get("tool_calls", ()):
            if c["id"] is None:
                c["id"] = f"functions.{c['function']['name']}:{k}"
            k += 1
            open_calls.append(c)
        expect = ("tool",) if open_calls else ("user",)


def _split(msgs: list[dict]) -> tuple[list[dict], dict | None]:
    """(prompt up to the last user or tool message, the assistant turn after it or None)."""
    _name_calls(msgs)
    last = max(i for i, m in enumerate(msgs) if m["role"] in ("user", "tool"))
    # The order rules leave at most one assistant message after it.
    ref = msgs[last + 1] if last + 1 < len(msgs) else None
    return msgs[: last + 1], ref


def parse_record(obj: Any) -> tuple[list[dict], dict | None, str, list[dict] | None]:
    """(prompt messages, reference or None, format name, tool specs or None)."""
    if type(obj) is not dict:
        raise Reject("not_an_object", f"line is a JSON {type_name(obj)}, not an object")
    # Fixed priority when several keys are present: messages > conversations > prompt.
    if "messages" in obj:
        msgs, fmt = _from_openai(obj["messages"]), "openai"
    elif "conversations" in obj:
        msgs, fmt = _merge_call_turns(_from_sharegpt(obj["conversations"])), "sharegpt"
    elif "prompt" in obj:
        msgs, fmt = _from_plain(obj), "plain"
    else:
        keys = ", ".join(sorted(map(str, obj))[:8])
        raise Reject(
            "unknown_format",
            f'no "messages", "conversations" or "prompt" key (keys: {keys or "none"})',
        )
    tools = _tools(obj) if fmt != "plain" else None
    prompt, ref = _split(msgs)
    return prompt, ref, fmt, tools


# Same output as json.dumps(..., sort_keys=True, ensure_ascii=False, separators=(",", ":")),
# but built once instead of per call.
_canon_encoder = json.JSONEncoder(
    sort_keys=True, ensure_ascii=False, separators=(",", ":"), check_circular=False
)
# The C encoder JSONEncoder.encode ends up in, called directly: the same text without
# encode's and iterencode's Python frames (~1.5 us a call, two calls a line).
_c_canon = json.encoder.c_make_encoder and json.encoder.c_make_encoder(
    None, _canon_encoder.default, json.encoder.c_encode_basestring, None, ":", ",", True, False, True)


def canon_encode(obj: Any, _join="".join) -> str:
    return _join(_c_canon(obj, 0)) if _c_canon else _canon_encoder.encode(obj)


_scan = json.scanner.c_make_scanner(json.JSONDecoder()) if json.scanner.c_make_scanner else None


def loads_line(text: str) -> Any:
    """json.loads(text), skipping its Python frames for a line that starts with a value and
    ends with its end of line; anything else (and every error) goes through json.loads
    itself, so the result and each error message are json.loads' own."""
    if _scan is not None and text and text[0] in '{["':
        try:
            obj, end = _scan(text, 0)
        except Exception:
            return json.loads(text)
        rest = len(text) - end
        if rest == 0 or (rest == 1 and text[end] == "\n") or text[end:] == "\r\n":
            return obj
    return json.loads(text)


def canonical_json(prompt: list[dict], reference: dict | None, tools: list[dict] | None = None) -> str:
    """The string hashed for dedupe and ids (exposed for tests and other tools). A record
    without tools hashes as it did before tools were read, so its sample id is unchanged."""
    obj: dict[str, Any] = {"messages": prompt, "reference": reference}
    if tools is not None:
        obj["tools"] = tools
    return _canon_encoder.encode(obj)


def tools_json(tools: list[dict] | None) -> str | None:
    """Tool specs as stored (the prompts' ``tools`` column): key order kept, since a
    template prints the specs as they are."""
    return None if tools is None else json.dumps(tools, ensure_ascii=False, separators=(",", ":"))

