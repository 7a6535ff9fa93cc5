"""Line-level validation helpers and the accounting invariant of ``ingest``.

Every line read ends up in exactly one bucket -- accepted, duplicate, rejected or
sampled out -- and ``ingest`` checks ``accepted + duplicates + rejected +
sampled_out == lines_read`` overall and per source before it writes anything.

Reject reason codes (the ``reason`` field of ``rejects.jsonl``; stable):

* read loop (ingest.py): ``line_too_long`` (over ``max_line_bytes``), ``blank_line``,
  ``invalid_utf8``, ``invalid_json``, ``invalid_unicode`` (a lone UTF-16 surrogate escape)
* formats (formats.py): ``not_an_object``, ``unknown_format``, ``bad_type``,
  ``unknown_role``, ``non_text_part``, ``empty_content``, ``no_user_turn``, ``bad_order``,
  ``bad_tools``, ``bad_tool_call``, ``bad_arguments``, ``orphan_tool_result``,
  ``missing_tool_result``

A UTF-8 BOM is skipped at the start of a file only; lines may end in ``\\n`` or ``\\r\\n``
(or nothing, at the end of a file).
"""

from __future__ import annotations

import json

COUNTERS = ("lines_read", "accepted", "duplicates", "rejected", "sampled_out")
INVARIANT = "accepted + duplicates + rejected + sampled_out == lines_read"

UTF8_BOM = b"\xef\xbb\xbf"


def json_error(text: str, err: Exception) -> str:
    """Error text for a bad line; re-parsed without the newline, which the hot path keeps
    (an unterminated string would otherwise be reported as a bad control character)."""
    if isinstance(err, RecursionError):
        return "JSON nested too deeply"
    try:
        json.loads(text.rstrip("\r\n"))
    except RecursionError:
        return "JSON nested too deeply"
    except ValueError as e:
        err = e
    return str(err)[:200]


def strip_eol(b: bytes) -> bytes:
    if b.endswith(b"\n"):
        b = b[:-1]
        if b.endswith(b"\r"):
            b = b[:-1]
    return b


def check_invariant(name: str, c: dict[str, int]) -> None:
    total = c["accepted"] + c["duplicates"] + c["rejected"] + c["sampled_out"]
    if total != c["lines_read"]:
        # Explicit raise rather than `assert`, which python -O would strip.
        raise AssertionError(f"{name}: {INVARIANT} violated: {total} != {c['lines_read']} ({c})")

