"""ingest's shortcuts around the json module give json's own results: `loads_line` (the C
scanner called directly) and `canon_encode` (the C encoder called directly)."""

import json

import pytest

from eagle_ray.data.formats import canon_encode, _canon_encoder, loads_line

LINES = [
    '{"messages": [{"role": "user", "content": "hi"}]}\n',
    '{"messages": [{"role": "user", "content": "hi"}]}\r\n',
    '{"messages": [{"role": "user", "content": "hi"}]}',
    '{"a": 1}  \n',  # trailing spaces: json.loads' own path
    '  {"a": 1}\n',
    '{"a": 1}{"b": 2}\n',  # extra data
    '{"a": 1} x\n',
    '{"messages": [{"role": "user", "content": "broken\n',
    '{"a": NaN, "b": Infinity, "c": -Infinity, "d": 1e999}\n',
    '{"a": "\\ud83d\\ude00 \\u00e9 \\t"}\n',
    '{"a": "\\ud800"}\n',
    '["a", 1, null, true]\n',
    '"a string"\n',
    '{"a": 1, "a": 2}\n',  # the last wins, as in json.loads
    '{"a": "tab\there"}\n',  # a raw control character: strict json.loads rejects it
    "\ufeff{\"a\": 1}\n",
    "[" * 5000 + "]" * 5000 + "\n",  # nested too deeply
    '{"a": [1, 2, {"b": {}}]}\n',
    "",
    "\n",
]


def _outcome(f, text):
    try:
        return ("ok", f(text))
    except RecursionError:
        return ("recursion",)
    except ValueError as e:
        return (type(e).__name__, str(e))


@pytest.mark.parametrize("text", LINES, ids=range(len(LINES)))
def test_loads_gives_json_loads_result_or_error(text):
    got, want = _outcome(loads_line, text), _outcome(json.loads, text)
    assert got == want
    if got[0] == "ok":
        assert json.dumps(got[1]) == json.dumps(want[1])  # same value, same key order


@pytest.mark.parametrize("obj", [
    [{"role": "user", "content": "a \"quoted\" \\ line\n\t\x01 é 😀 \u2028"}],
    {"role": "assistant", "content": "x", "reasoning_content": "why"},
    [],
    {"z": [1, 2.5, None, True], "a": {"c": "d", "b": "e"}},
])
def test_canon_encode_gives_the_encoders_text(obj):
    assert canon_encode(obj) == _canon_encoder.encode(obj) == json.dumps(
        obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
