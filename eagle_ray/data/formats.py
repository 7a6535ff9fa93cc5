"""Per-line conversation formats: one parsed JSON value -> canonical (prompt, reference).

Accepted line formats (one JSON object per line; other top-level keys are ignored):

* OpenAI:   ``{"messages": [{"role": ..., "content": ..., "reasoning_content": ...}, ...]}``
* ShareGPT: ``{"conversations": [{"from": ..., "value": ...}, ...]}``
* Plain:    ``{"prompt": ..., "response"|"completion": ...}``

When several keys are present the first of ``messages``, ``conversations``, ``prompt``
wins. OpenAI ``content`` may be a string or a list of text parts (joined); ``developer``
maps to ``system``; ``reasoning_content`` is kept, and allowed on assistant messages only
(null or blank counts as absent). ShareGPT roles are matched case-insensitively (human/user,
gpt/assistant/chatgpt, system). All formats normalise to ``{"role", "content"[, "reasoning_content"]}`` messages:
an optional system message, then turns alternating user/assistant starting with user. The
prompt runs up to the last user turn; an assistant message after it is the reference.

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


_ROLE_OPENAI = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_ROLE_SHAREGPT = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
}


def type_name(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 40 else r[:37] + "..."


def _join_parts(content: Any, where: str) -> str:
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
    return "".join(texts)


def _from_openai(raw: Any) -> list[dict[str, str]]:
    if type(raw) is not list:
        raise Reject("bad_type", f'"messages" must be a list, got {type_name(raw)}')
    out = []
    for i, m in enumerate(raw):
        if type(m) is not dict:
            raise Reject("bad_type", f"messages[{i}] must be an object, got {type_name(m)}")
        role = m.get("role")
        if type(role) is not str:
            raise Reject("bad_type", f"messages[{i}].role must be a string, got {type_name(role)}")
        r = _ROLE_OPENAI.get(role)
        if r is None:
            raise Reject(
                "unknown_role",
                f"messages[{i}].role {_short(role)} is not one of system, developer, user, assistant",
            )
        content = m.get("content")
        if type(content) is not str:
            content = _join_parts(content, f"messages[{i}]")
        # isspace() stops at the first non-space char; strip() would copy the whole string.
        if not content or content.isspace():
            raise Reject("empty_content", f"messages[{i}] ({r}) has empty content")
        msg = {"role": r, "content": content}
        rc = m.get("reasoning_content")
        if rc is not None:  # null is common in exported logs; treat it as absent
            if type(rc) is not str:
                raise Reject(
                    "bad_type", f"messages[{i}].reasoning_content must be a string, got {type_name(rc)}"
                )
            if rc and not rc.isspace():
                if r != "assistant":
                    raise Reject(
                        "bad_type", f"messages[{i}] ({r}) has reasoning_content; only assistant messages may"
                    )
                msg["reasoning_content"] = rc
        out.append(msg)
    return out


def _from_sharegpt(raw: Any) -> list[dict[str, str]]:
    if type(raw) is not list:
        raise Reject("bad_type", f'"conversations" must be a list, got {type_name(raw)}')
    out = []
    for i, t in enumerate(raw):
        if type(t) is not dict:
            raise Reject("bad_type", f"conversations[{i}] must be an object, got {type_name(t)}")
        frm = t.get("from")
        if type(frm) is not str:
            raise Reject("bad_type", f'conversations[{i}]["from"] must be a string, got {type_name(frm)}')
        r = _ROLE_SHAREGPT.get(frm) or _ROLE_SHAREGPT.get(frm.lower())
        if r is None:
            raise Reject(
                "unknown_role",
                f'conversations[{i}]["from"] {_short(frm)} is not one of human, user, gpt, '
                "assistant, chatgpt, system",
            )
        value = t.get("value")
        if type(value) is not str:
            raise Reject("bad_type", f"conversations[{i}].value must be a string, got {type_name(value)}")
        if not value or value.isspace():
            raise Reject("empty_content", f"conversations[{i}] ({r}) has empty value")
        out.append({"role": r, "content": value})
    return out


def _from_plain(obj: dict) -> list[dict[str, str]]:
    prompt = obj["prompt"]
    if type(prompt) is not str:
        raise Reject("bad_type", f'"prompt" must be a string, got {type_name(prompt)}')
    if not prompt or prompt.isspace():
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
        if not resp or resp.isspace():
            raise Reject("empty_content", f'"{key}" is empty')
        out.append({"role": "assistant", "content": resp})
    return out


def _split(msgs: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, str] | None]:
    """Check turn order; return (prompt up to the last user turn, reference or None)."""
    n = len(msgs)
    if n == 0:
        raise Reject("no_user_turn", "conversation has no messages")
    start = 1 if msgs[0]["role"] == "system" else 0
    expect = "user"
    last_user = -1
    for i in range(start, n):
        r = msgs[i]["role"]
        if r != expect:
            if not any(m["role"] == "user" for m in msgs):
                raise Reject("no_user_turn", "conversation has no user message")
            if r == "system":
                raise Reject(
                    "bad_order", f"system message at position {i}; only one is allowed, at position 0"
                )
            raise Reject(
                "bad_order",
                f"message {i} is {r} but {expect} was expected "
                "(after an optional system message, turns alternate user/assistant starting with user)",
            )
        if r == "user":
            last_user = i
            expect = "assistant"
        else:
            expect = "user"
    if last_user < 0:
        raise Reject("no_user_turn", "conversation has no user message")
    # Strict alternation means at most one assistant message follows the last user turn.
    ref = msgs[last_user + 1] if last_user + 1 < n else None
    return msgs[: last_user + 1], ref


def parse_record(obj: Any) -> tuple[list[dict[str, str]], dict[str, str] | None, str]:
    if type(obj) is not dict:
        raise Reject("not_an_object", f"line is a JSON {type_name(obj)}, not an object")
    # Fixed priority when several keys are present: messages > conversations > prompt.
    if "messages" in obj:
        msgs, fmt = _from_openai(obj["messages"]), "openai"
    elif "conversations" in obj:
        msgs, fmt = _from_sharegpt(obj["conversations"]), "sharegpt"
    elif "prompt" in obj:
        msgs, fmt = _from_plain(obj), "plain"
    else:
        keys = ", ".join(sorted(map(str, obj))[:8])
        raise Reject(
            "unknown_format",
            f'no "messages", "conversations" or "prompt" key (keys: {keys or "none"})',
        )
    prompt, ref = _split(msgs)
    return prompt, ref, fmt


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


def canonical_json(prompt: list[dict[str, str]], reference: dict[str, str] | None) -> str:
    """The string hashed for dedupe and ids (exposed for tests and other tools)."""
    return _canon_encoder.encode({"messages": prompt, "reference": reference})

