"""Unit tests for eagle_ray.data.ingest (fast; everything lives in tmp_path)."""

from __future__ import annotations

import hashlib
import json
import os
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle_ray.data import ingest as ingest_mod
from eagle_ray.data.ingest import (
                                   PROMPTS_SCHEMA,
                                   IngestResult,
                                   SourceSpec,
                                   canonical_json,
                                   ingest,
                                   )

COUNTERS = ("lines_read", "accepted", "duplicates", "rejected", "sampled_out")


# --------------------------------------------------------------------------- helpers


def write_lines(path: Path, lines: list) -> Path:
    """Write objects as JSON lines; str/bytes items are written verbatim (plus newline)."""
    with open(path, "wb") as f:
        for x in lines:
            if isinstance(x, bytes):
                f.write(x + b"\n")
            elif isinstance(x, str):
                f.write(x.encode("utf-8") + b"\n")
            else:
                f.write(json.dumps(x).encode("utf-8") + b"\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def rows(res: IngestResult) -> list[dict]:
    return pq.read_table(res.out_dir / "prompts.parquet").to_pylist()


def check(res: IngestResult) -> dict:
    """Counters add up overall and per source, and match the output files; returns report.json."""
    out = res.out_dir
    c = {k: getattr(res, k) for k in COUNTERS}
    assert c["accepted"] + c["duplicates"] + c["rejected"] + c["sampled_out"] == c["lines_read"]
    for path, pc in res.per_source.items():
        assert set(pc) >= set(COUNTERS), path
        assert pc["accepted"] + pc["duplicates"] + pc["rejected"] + pc["sampled_out"] == pc["lines_read"], path
    for k in COUNTERS:
        assert sum(pc[k] for pc in res.per_source.values()) == c[k], k
    assert sum(res.reject_reasons.values()) == res.rejected
    assert res.invariant_holds

    table = pq.read_table(out / "prompts.parquet")
    assert table.num_rows == res.accepted
    for f in PROMPTS_SCHEMA:
        assert table.schema.field(f.name).type == f.type, f.name
    rejects = read_jsonl(out / "rejects.jsonl")
    assert len(rejects) == res.rejected
    assert len(read_jsonl(out / "duplicates.jsonl")) == res.duplicates
    assert len(read_jsonl(out / "sampled_out.jsonl")) == res.sampled_out
    for r in rejects:
        assert set(r) == {"source", "line", "byte_offset", "reason", "message", "raw", "raw_bytes",
                          "raw_truncated"}
        assert r["line"] >= 1 and r["message"]
    report = json.loads((out / "report.json").read_text())
    for k in COUNTERS:
        assert report[k] == c[k]
    assert report["per_source"] == res.per_source
    assert report["reject_reasons"] == res.reject_reasons
    assert report["invariant"]["holds"] is True
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]
    return report


def run(tmp_path: Path, sources, name="out", **kw) -> IngestResult:
    specs = [s if isinstance(s, SourceSpec) else SourceSpec.parse(str(s)) for s in sources]
    res = ingest(specs, tmp_path / name, **kw)
    check(res)
    return res


def oai(*turns, **extra):
    """oai(("user", "hi"), ("assistant", "yo")) -> OpenAI-style line object."""
    return {"messages": [{"role": r, "content": c} for r, c in turns], **extra}


def qa(i: int) -> dict:
    return oai(("user", f"question {i}"), ("assistant", f"answer {i}"))


def spec_id(messages, reference) -> str:
    """The id as the spec defines it, computed independently of the module."""
    canon = json.dumps({"messages": messages, "reference": reference}, sort_keys=True,
                       ensure_ascii=False, separators=(",", ":"))
    return "s" + hashlib.sha256(canon.encode("utf-8")).hexdigest()[:20]


# --------------------------------------------------------------------------- SourceSpec


def test_source_spec_parse():
    assert SourceSpec.parse("data.jsonl") == SourceSpec(path="data.jsonl")
    assert SourceSpec.parse("data.jsonl:1000") == SourceSpec(path="data.jsonl", count=1000)
    assert SourceSpec.parse("data.jsonl:0.25") == SourceSpec(path="data.jsonl", fraction=0.25)
    assert SourceSpec.parse("data.jsonl:1.0") == SourceSpec(path="data.jsonl", fraction=1.0)
    assert SourceSpec.parse("data.jsonl:1") == SourceSpec(path="data.jsonl", count=1)
    # ':' inside paths: only a numeric suffix is a spec.
    assert SourceSpec.parse("s3:bucket/x.jsonl") == SourceSpec(path="s3:bucket/x.jsonl")
    assert SourceSpec.parse("a:b.jsonl:7") == SourceSpec(path="a:b.jsonl", count=7)
    assert SourceSpec.parse("logs:nan") == SourceSpec(path="logs:nan")


@pytest.mark.parametrize("text, needle", [
    ("data.jsonl:0", "count"),
    ("data.jsonl:-5", "count"),
    ("data.jsonl:1.5", "use a count instead"),
    ("data.jsonl:0.0", "fraction"),
    ("data.jsonl:-0.5", "fraction"),
    (":10", "no path"),
    ("", "empty"),
])
def test_source_spec_parse_invalid(text, needle):
    with pytest.raises(ValueError, match=needle):
        SourceSpec.parse(text)


def test_source_spec_constructor_validates():
    with pytest.raises(ValueError, match="not both"):
        SourceSpec(path="a", count=1, fraction=0.5)
    with pytest.raises(ValueError):
        SourceSpec(path="a", count=0)
    with pytest.raises(ValueError):
        SourceSpec(path="a", fraction=2.0)
    with pytest.raises(ValueError):
        SourceSpec(path="")


# --------------------------------------------------------------------------- formats


def test_openai_basic_and_schema(tmp_path):
    src = write_lines(tmp_path / "a.jsonl", [
        oai(("user", "hi"), ("assistant", "hello"), id=7, metadata={"x": 1}),
        oai(("user", "only a prompt")),
    ])
    res = run(tmp_path, [src])
    assert (res.lines_read, res.accepted, res.rejected) == (2, 2, 0)
    table = pq.read_table(res.out_dir / "prompts.parquet")
    assert table.schema.names == PROMPTS_SCHEMA.names
    by_line = {r["source_line"]: r for r in table.to_pylist()}
    r1 = by_line[1]
    assert json.loads(r1["messages"]) == [{"role": "user", "content": "hi"}]
    assert json.loads(r1["reference"]) == {"role": "assistant", "content": "hello"}
    assert r1["num_turns"] == 1
    assert r1["source"] == src.stem
    assert r1["sample_id"] == spec_id([{"role": "user", "content": "hi"}],
                                      {"role": "assistant", "content": "hello"})
    assert r1["sample_id"] == "s" + r1["content_hash"][:20]
    assert by_line[2]["reference"] is None
    assert by_line[2]["sample_id"] == spec_id([{"role": "user", "content": "only a prompt"}], None)


def test_openai_reasoning_developer_and_content_parts(tmp_path):
    src = write_lines(tmp_path / "a.jsonl", [
        {"messages": [
            {"role": "developer", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
            {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "a2", "reasoning_content": "why"},
        ]},
        # empty / null reasoning is treated as absent
        {"messages": [{"role": "user", "content": "q"},
                      {"role": "assistant", "content": "a", "reasoning_content": ""}]},
        {"messages": [{"role": "user", "content": "q2"},
                      {"role": "assistant", "content": "a", "reasoning_content": None}]},
    ])
    res = run(tmp_path, [src])
    assert res.accepted == 3 and res.rejected == 0
    by_line = {r["source_line"]: r for r in rows(res)}
    msgs = json.loads(by_line[1]["messages"])
    assert msgs == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hel\nlo"},  # text parts joined as vLLM's chat path joins them
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "again"},
    ]
    assert json.loads(by_line[1]["reference"]) == {"role": "assistant", "content": "a2",
                                                   "reasoning_content": "why"}
    assert by_line[1]["num_turns"] == 4
    assert json.loads(by_line[2]["reference"]) == {"role": "assistant", "content": "a"}
    assert "reasoning_content" not in json.loads(by_line[3]["reference"])


def test_non_text_content_part_rejected(tmp_path):
    src = write_lines(tmp_path / "a.jsonl", [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    ])
    res = run(tmp_path, [src])
    assert res.rejected == 1 and res.reject_reasons == {"non_text_part": 1}


def test_sharegpt(tmp_path):
    src = write_lines(tmp_path / "a.jsonl", [
        {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q1"},
                           {"from": "gpt", "value": "a1"}, {"from": "user", "value": "q2"},
                           {"from": "chatgpt", "value": "a2"}], "id": "x"},
        {"conversations": [{"from": "user", "value": "u"}, {"from": "assistant", "value": "v"}]},
    ])
    res = run(tmp_path, [src])
    assert res.accepted == 2 and res.rejected == 0
    by_line = {r["source_line"]: r for r in rows(res)}
    assert json.loads(by_line[1]["messages"]) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
    ]
    assert json.loads(by_line[1]["reference"]) == {"role": "assistant", "content": "a2"}
    assert json.loads(by_line[2]["reference"]) == {"role": "assistant", "content": "v"}


def test_plain(tmp_path):
    src = write_lines(tmp_path / "a.jsonl", [
        {"prompt": "p1", "response": "r1"},
        {"prompt": "p2", "completion": "c2"},
        {"prompt": "p3"},
        {"prompt": "p4", "response": None},
    ])
    res = run(tmp_path, [src])
    assert res.accepted == 4
    by_line = {r["source_line"]: r for r in rows(res)}
    assert json.loads(by_line[1]["messages"]) == [{"role": "user", "content": "p1"}]
    assert json.loads(by_line[1]["reference"]) == {"role": "assistant", "content": "r1"}
    assert json.loads(by_line[2]["reference"]) == {"role": "assistant", "content": "c2"}
    assert by_line[3]["reference"] is None and by_line[4]["reference"] is None
    assert by_line[3]["num_turns"] == 1


def test_multi_turn_split(tmp_path):
    src = write_lines(tmp_path / "a.jsonl", [
        oai(("system", "S"), ("user", "u1"), ("assistant", "a1"), ("user", "u2"), ("assistant", "a2")),
        oai(("user", "u1"), ("assistant", "a1"), ("user", "u2")),
    ])
    res = run(tmp_path, [src])
    by_line = {r["source_line"]: r for r in rows(res)}
    assert [m["content"] for m in json.loads(by_line[1]["messages"])] == ["S", "u1", "a1", "u2"]
    assert json.loads(by_line[1]["reference"])["content"] == "a2"
    assert by_line[1]["num_turns"] == 4
    assert [m["content"] for m in json.loads(by_line[2]["messages"])] == ["u1", "a1", "u2"]
    assert by_line[2]["reference"] is None and by_line[2]["num_turns"] == 3


def test_same_conversation_in_different_formats_dedupes(tmp_path):
    src = write_lines(tmp_path / "a.jsonl", [
        oai(("user", "q"), ("assistant", "a")),
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"prompt": "q", "response": "a"},
    ])
    res = run(tmp_path, [src])
    assert (res.accepted, res.duplicates) == (1, 2)


def test_canonical_json_matches_spec_formula():
    msgs = [{"role": "user", "content": "héllo \"x\""}]
    ref = {"role": "assistant", "content": "ü", "reasoning_content": "r"}
    expected = json.dumps({"messages": msgs, "reference": ref}, sort_keys=True, ensure_ascii=False,
                          separators=(",", ":"))
    assert canonical_json(msgs, ref) == expected


# --------------------------------------------------------------------------- bad input


BAD_LINES = [
    ('{"messages": [', "invalid_json"),
    ("[1, 2]", "not_an_object"),
    ('"just a string"', "not_an_object"),
    ('{"foo": 1}', "unknown_format"),
    ('{"messages": "hi"}', "bad_type"),
    ('{"messages": ["hi"]}', "bad_type"),
    ('{"messages": [{"role": 1, "content": "x"}]}', "bad_type"),
    ('{"messages": [{"role": "user", "content": 5}]}', "bad_type"),
    ('{"messages": [{"role": "user", "content": null}]}', "bad_type"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", '
     '"reasoning_content": 3}]}', "bad_type"),
    ('{"conversations": [{"from": "human", "value": 1}]}', "bad_type"),
    ('{"prompt": 3}', "bad_type"),
    ('{"prompt": "p", "response": 3}', "bad_type"),
    ('{"messages": [{"role": "tool_result", "content": "x"}]}', "unknown_role"),
    ('{"conversations": [{"from": "function_response", "value": "x"}]}', "unknown_role"),
    ('{"messages": [{"role": "tool", "content": "x"}]}', "no_user_turn"),
    ('{"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "x"}]}',
     "bad_tool_call"),
    ('{"messages": [{"role": "user", "content": "   "}]}', "empty_content"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}',
     "empty_content"),
    ('{"prompt": "\\n\\t"}', "empty_content"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q2"}]}', "bad_order"),
    ('{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}',
     "bad_order"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]}', "bad_order"),
    ('{"messages": [{"role": "system", "content": "s"}, {"role": "system", "content": "s2"}, '
     '{"role": "user", "content": "q"}]}', "bad_order"),
    ('{"messages": [{"role": "system", "content": "s"}]}', "no_user_turn"),
    ('{"messages": [{"role": "assistant", "content": "a"}]}', "no_user_turn"),
    ('{"messages": []}', "no_user_turn"),
    ('{"prompt": "\\ud800"}', "invalid_unicode"),
    ("   ", "blank_line"),
    ("", "blank_line"),
]


@pytest.mark.parametrize("line, reason", BAD_LINES)
def test_bad_line_rejected(tmp_path, line, reason):
    good = json.dumps({"prompt": "fine"})
    src = write_lines(tmp_path / "a.jsonl", [good, line, good.replace("fine", "fine too")])
    res = run(tmp_path, [src])
    assert (res.lines_read, res.accepted, res.rejected) == (3, 2, 1)
    assert res.reject_reasons == {reason: 1}
    (rej,) = read_jsonl(res.out_dir / "rejects.jsonl")
    assert rej["reason"] == reason and rej["line"] == 2
    assert rej["byte_offset"] == len(good) + 1
    assert rej["raw"] == line and rej["raw_bytes"] == len(line.encode()) and not rej["raw_truncated"]
    assert rej["source"] == src.stem


def test_invalid_json_message_and_deep_nesting(tmp_path):
    src = write_lines(tmp_path / "a.jsonl", ['{"prompt": "unterminated', "[" * 100_000 + "]" * 100_000])
    res = run(tmp_path, [src])
    assert res.reject_reasons == {"invalid_json": 2}
    r1, r2 = read_jsonl(res.out_dir / "rejects.jsonl")
    assert "Unterminated string" in r1["message"]
    assert r2["line"] == 2 and r2["raw_bytes"] == 200_000


def test_invalid_utf8(tmp_path):
    bad = b'{"prompt": "caf\xff"}'
    src = write_lines(tmp_path / "a.jsonl", [{"prompt": "ok"}, bad])
    res = run(tmp_path, [src])
    assert res.reject_reasons == {"invalid_utf8": 1} and res.accepted == 1
    (rej,) = read_jsonl(res.out_dir / "rejects.jsonl")
    assert rej["line"] == 2
    pos = bad.index(b"\xff")
    assert f"byte {pos} " in rej["message"]
    assert "\ufffd" in rej["raw"] and rej["raw_bytes"] == len(bad)


def test_crlf_offsets_and_bom(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b"}\r\nnope\r\n{"prompt": "c"}')
    res = run(tmp_path, [src])
    assert (res.lines_read, res.accepted, res.rejected) == (4, 3, 1)
    (rej,) = read_jsonl(res.out_dir / "rejects.jsonl")
    assert rej["raw"] == "nope" and rej["raw_bytes"] == 4
    assert rej["byte_offset"] == src.read_bytes().index(b"nope")
    assert sorted(json.loads(r["messages"])[0]["content"] for r in rows(res)) == ["a", "b", "c"]


def test_line_length_limit_boundary(tmp_path):
    limit = 64
    pad = lambda n: json.dumps({"prompt": "x" * (n - len('{"prompt": ""}'))})  # noqa: E731
    exact, over = pad(limit), pad(limit + 1)
    assert len(exact) == limit and len(over) == limit + 1
    src = tmp_path / "a.jsonl"
    # exactly at the limit is fine, also with a CRLF that the +1 read limit splits
    src.write_bytes(exact.encode() + b"\n" + exact.replace("x", "y").encode() + b"\r\n"
                    + over.encode() + b"\n")
    res = run(tmp_path, [src], max_line_bytes=limit)
    assert (res.lines_read, res.accepted, res.rejected) == (3, 2, 1)
    (rej,) = read_jsonl(res.out_dir / "rejects.jsonl")
    assert rej["reason"] == "line_too_long" and rej["line"] == 3 and rej["raw_bytes"] == limit + 1


def _write_huge_line(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.write(b'{"prompt": "')
        block = b"x" * (1 << 20)
        left = size - len(b'{"prompt": "') - 2
        while left > 0:
            f.write(block[:left])
            left -= len(block)
        f.write(b'"}\n')
        f.write(b'{"prompt": "after"}\n')


def test_50mb_line_is_one_reject_and_memory_bounded(tmp_path):
    size = 50_000_000
    src = tmp_path / "huge.jsonl"
    _write_huge_line(src, size)
    # Warm up lazy imports (pyarrow/parquet) so they do not count towards the peak.
    run(tmp_path, [write_lines(tmp_path / "w.jsonl", [{"prompt": "w"}])], name="warm")

    tracemalloc.start()
    try:
        res = ingest([SourceSpec(path=str(src))], tmp_path / "o1", max_line_bytes=1 << 20)
        small_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        res_default = ingest([SourceSpec(path=str(src))], tmp_path / "o2")
        default_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    for r in (res, res_default):
        check(r)
        assert (r.lines_read, r.rejected, r.accepted) == (2, 1, 1)
        assert r.reject_reasons == {"line_too_long": 1}
        (rej,) = read_jsonl(r.out_dir / "rejects.jsonl")
        assert rej["line"] == 1 and rej["byte_offset"] == 0
        assert rej["raw_bytes"] == size and rej["raw_truncated"] is True
        assert len(rej["raw"].encode()) == 64 << 10 and rej["raw"].startswith('{"prompt": "xxx')
        assert json.loads(rows(r)[0]["messages"])[0]["content"] == "after"
    # The line is never held whole: the peak tracks max_line_bytes, not the 50 MB line.
    assert small_peak < 12_000_000, small_peak
    assert default_peak < 45_000_000, default_peak


def test_blank_lines_are_counted(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_bytes(b'\n  \n{"prompt": "a"}\n\t\n\n')
    res = run(tmp_path, [src])
    assert (res.lines_read, res.accepted, res.rejected) == (5, 1, 4)
    assert res.reject_reasons == {"blank_line": 4}
    assert [r["line"] for r in read_jsonl(res.out_dir / "rejects.jsonl")] == [1, 2, 4, 5]


def test_empty_file_warns_and_writes_empty_outputs(tmp_path):
    src = tmp_path / "empty.jsonl"
    src.write_bytes(b"")
    msgs: list[str] = []
    res = run(tmp_path, [src], progress=msgs.append)
    assert res.lines_read == 0 and res.accepted == 0
    assert res.per_source[src.stem] == dict.fromkeys(COUNTERS, 0)
    assert any("empty" in m for m in msgs)
    assert any("empty" in w for w in res.warnings)
    table = pq.read_table(res.out_dir / "prompts.parquet")
    assert table.num_rows == 0 and table.schema.names == PROMPTS_SCHEMA.names


def test_nothing_accepted_still_writes_outputs(tmp_path):
    src = write_lines(tmp_path / "a.jsonl", ["garbage", "[]"])
    res = run(tmp_path, [src])
    assert (res.accepted, res.rejected) == (0, 2)
    assert pq.read_table(res.out_dir / "prompts.parquet").num_rows == 0


def test_missing_source_raises_before_any_output(tmp_path):
    good = write_lines(tmp_path / "a.jsonl", [{"prompt": "a"}])
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        ingest([SourceSpec(path=str(good)), SourceSpec(path=str(tmp_path / "nope.jsonl"))], out)
    assert not out.exists()
    (tmp_path / "adir").mkdir()
    with pytest.raises(ValueError, match="adir"):
        ingest([SourceSpec(path=str(good)), SourceSpec(path=str(tmp_path / "adir"))], out)
    assert not out.exists()
    with pytest.raises(ValueError, match="twice"):
        ingest([SourceSpec(path=str(good)), SourceSpec(path=str(good), count=1)], out)
    assert not out.exists()


def test_progress_reports_rate(tmp_path, monkeypatch):
    monkeypatch.setattr(ingest_mod, "PROGRESS_EVERY", 10)
    src = write_lines(tmp_path / "a.jsonl", [qa(i) for i in range(35)])
    msgs: list[str] = []
    run(tmp_path, [src], progress=msgs.append)
    ticks = [m for m in msgs if "lines/s" in m and "lines read" in m]
    assert len(ticks) == 3 and ticks[0].startswith("10 lines read")


# --------------------------------------------------------------------------- ids and dedupe


def test_ids_stable_across_runs_and_added_sources(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [qa(i) for i in range(20)])
    b = write_lines(tmp_path / "b.jsonl", [qa(i) for i in range(100, 110)])
    r1 = rows(run(tmp_path, [a], name="o1"))
    r2 = rows(run(tmp_path, [a], name="o2"))
    assert r1 == r2  # same ids, same order
    r3 = rows(run(tmp_path, [a, b], name="o3"))
    ids_a = {(r["source_line"], r["sample_id"]) for r in r1}
    assert {(r["source_line"], r["sample_id"]) for r in r3 if r["source"] == a.stem} == ids_a
    assert len({r["sample_id"] for r in r3}) == 30
    for r in r1:
        i = r["source_line"] - 1
        assert r["sample_id"] == spec_id([{"role": "user", "content": f"question {i}"}],
                                         {"role": "assistant", "content": f"answer {i}"})


def test_dedupe_across_and_within_sources(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [qa(1), qa(2), qa(1)])
    b = write_lines(tmp_path / "b.jsonl", [qa(2), qa(3)])
    res = run(tmp_path, [a, b])
    assert (res.accepted, res.duplicates) == (3, 2)
    assert res.per_source[a.stem]["duplicates"] == 1 and res.per_source[b.stem]["duplicates"] == 1
    kept = {r["sample_id"]: (r["source"], r["source_line"]) for r in rows(res)}
    dups = read_jsonl(res.out_dir / "duplicates.jsonl")
    assert [(d["source"], d["line"]) for d in dups] == [(a.stem, 3), (b.stem, 1)]
    for d in dups:
        assert kept[d["sample_id"]] == (d["kept_source"], d["kept_line"])
        assert "question" not in json.dumps(d)  # no raw text
    assert kept[spec_id([{"role": "user", "content": "question 2"}],
                        {"role": "assistant", "content": "answer 2"})] == (a.stem, 2)
    # Source order decides which copy wins.
    res2 = run(tmp_path, [b, a], name="o2")
    assert {r["sample_id"]: r["source"] for r in rows(res2)}[dups[1]["sample_id"]] == b.stem


# --------------------------------------------------------------------------- mixing


def test_mix_count(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [qa(i) for i in range(10)])
    res = run(tmp_path, [f"{a}:3"])
    assert (res.accepted, res.sampled_out) == (3, 7)
    kept = {r["sample_id"] for r in rows(res)}
    out = read_jsonl(res.out_dir / "sampled_out.jsonl")
    assert {o["sample_id"] for o in out}.isdisjoint(kept)
    kept_lines = {r["source_line"] for r in rows(res)}
    assert sorted(o["line"] for o in out) == sorted(set(range(1, 11)) - kept_lines)
    assert all(o["source"] == a.stem for o in out)


def test_mix_fraction(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [qa(i) for i in range(10)])
    b = write_lines(tmp_path / "b.jsonl", [qa(i) for i in range(100, 120)])
    res = run(tmp_path, [f"{a}:0.3", str(b)])
    assert res.per_source[a.stem]["accepted"] == 3 and res.per_source[a.stem]["sampled_out"] == 7
    assert res.per_source[b.stem]["accepted"] == 20 and res.accepted == 23


def test_mix_fraction_counts_after_dedupe(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [qa(i % 5) for i in range(10)] + ["bad"])
    res = run(tmp_path, [f"{a}:0.4"])
    pc = res.per_source[a.stem]
    assert pc == {"lines_read": 11, "accepted": 2, "duplicates": 5, "rejected": 1, "sampled_out": 3}


def test_mix_shortfall(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [qa(i) for i in range(10)])
    msgs: list[str] = []
    res = run(tmp_path, [f"{a}:50"], progress=msgs.append)
    assert (res.accepted, res.sampled_out) == (10, 0)
    assert res.shortfall == {a.stem: 40}
    assert any("50" in m and "10" in m for m in msgs)
    report = json.loads((res.out_dir / "report.json").read_text())
    assert report["sources"][0]["shortfall"] == 40 and report["shortfall"] == {a.stem: 40}


def test_mix_seeded_determinism(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [qa(i) for i in range(60)])
    b = write_lines(tmp_path / "b.jsonl", [qa(i) for i in range(100, 140)])
    srcs = [f"{a}:25", f"{b}:0.5"]
    r1 = rows(run(tmp_path, srcs, name="o1", seed=1))
    r2 = rows(run(tmp_path, srcs, name="o2", seed=1))
    r3 = rows(run(tmp_path, srcs, name="o3", seed=2))
    assert r1 == r2
    assert [r["sample_id"] for r in r1] != [r["sample_id"] for r in r3]
    assert {r["sample_id"] for r in r1} != {r["sample_id"] for r in r3}  # selection differs too
    assert len(r3) == 45
    # The final mix is shuffled, not in source/line order.
    assert [(r["source"], r["source_line"]) for r in r1] != sorted((r["source"], r["source_line"]) for r in r1)
    assert (tmp_path / "o1" / "sampled_out.jsonl").read_bytes() == (tmp_path / "o2" / "sampled_out.jsonl").read_bytes()


def test_adding_a_source_keeps_other_selection(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [qa(i) for i in range(50)])
    b = write_lines(tmp_path / "b.jsonl", [qa(i) for i in range(100, 150)])
    only_a = rows(run(tmp_path, [f"{a}:10"], name="o1", seed=3))
    both = rows(run(tmp_path, [f"{b}:0.2", f"{a}:10"], name="o2", seed=3))
    assert {r["sample_id"] for r in only_a} == {r["sample_id"] for r in both if r["source"] == a.stem}


# --------------------------------------------------------------------------- outputs


def test_report_contents(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [qa(1), "x", qa(1)])
    report = check(ingest([SourceSpec.parse(f"{a}:1")], tmp_path / "out", seed=9))
    assert report["seed"] == 9
    (s,) = report["sources"]
    assert s["path"] == str(a) and s["count"] == 1 and s["fraction"] is None
    assert s["size_bytes"] == a.stat().st_size
    assert s["sha256"] == hashlib.sha256(a.read_bytes()).hexdigest()
    assert report["reject_reasons"] == {"invalid_json": 1}
    assert report["invariant"]["formula"] == "accepted + duplicates + rejected + sampled_out == lines_read"


def test_annotate_adds_columns(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [qa(i) for i in range(5)])

    def annotate(t: pa.Table) -> pa.Table:
        return t.append_column("n_chars", pa.array([len(m) for m in t["messages"].to_pylist()], pa.int64()))

    res = run(tmp_path, [a], annotate=annotate)
    t = pq.read_table(res.out_dir / "prompts.parquet")
    assert "n_chars" in t.column_names
    assert t["n_chars"].to_pylist() == [len(m) for m in t["messages"].to_pylist()]


def test_atomic_outputs_no_temp_files_and_failure_keeps_old(tmp_path):
    a = write_lines(tmp_path / "a.jsonl", [qa(i) for i in range(5)])
    res = run(tmp_path, [a])
    out = res.out_dir
    names = sorted(p.name for p in out.iterdir())
    assert names == ["duplicates.jsonl", "prompts.parquet", "rejects.jsonl", "report.json",
                     "sampled_out.jsonl"]
    before = {n: (out / n).read_bytes() for n in names}

    b = write_lines(tmp_path / "b.jsonl", [qa(i) for i in range(100, 103)] + ["junk"])

    def boom(t: pa.Table) -> pa.Table:
        raise RuntimeError("annotate failed")

    with pytest.raises(RuntimeError, match="annotate failed"):
        ingest([SourceSpec(path=str(b))], out, annotate=boom)
    assert sorted(p.name for p in out.iterdir()) == names  # no *.tmp-<pid> left behind
    assert {n: (out / n).read_bytes() for n in names} == before

    # A successful rerun replaces every file.
    res2 = run(tmp_path, [b])
    assert res2.accepted == 3 and res2.rejected == 1
    assert os.listdir(out) and not any(".tmp-" in n for n in os.listdir(out))


def test_source_labels_stem_or_given(tmp_path):
    """Rows, counters and the report name a source by its label: the file's stem, or the
    label given after '::'; two sources that would share a label are refused up front."""
    a = write_lines(tmp_path / "mine.jsonl", [qa(i) for i in range(6)])
    sub = tmp_path / "other"
    sub.mkdir()
    b = write_lines(sub / "mine.jsonl", [qa(i) for i in range(100, 104)])
    with pytest.raises(ValueError, match="both be labelled 'mine'.*PATH::LABEL"):
        run(tmp_path, [a, b], name="clash")
    res = run(tmp_path, [f"{a}:3::personal", str(b)], name="ok")
    assert set(res.per_source) == {"personal", "mine"}
    assert {r["source"] for r in rows(res)} == {"personal", "mine"}
    report = json.loads((res.out_dir / "report.json").read_text())
    assert [(s["label"], s["path"]) for s in report["sources"]] == [("personal", str(a)), ("mine", str(b))]
    assert SourceSpec.parse("x/y.jsonl:0.5::g-1").describe() == "x/y.jsonl:0.5::g-1"
    with pytest.raises(ValueError, match="label"):
        SourceSpec.parse("x.jsonl::bad label")
