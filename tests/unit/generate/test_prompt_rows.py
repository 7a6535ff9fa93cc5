"""The prompt set as read tasks (generate/prompts.py), Arrow resume bookkeeping, generation
part compaction and consolidation from parts a chunk at a time: the same conversations,
rejects and counts as before, with no Python object per sample on the driver."""

import json
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle_ray.data.ids import completion_index, prompt_id
from eagle_ray.generate.prompts import (ParquetRows, completion_indices, count_not_in, prompt_ids)
from eagle_ray.generate.stage import CONVERSATIONS_SCHEMA


def _prompts(path, n, row_group=7):
    t = pa.table({"sample_id": [f"{i:064x}" for i in range(n)],
                  "source": ["mine" if i % 3 else "general" for i in range(n)],
                  "messages": [json.dumps([{"role": "user", "content": f"q{i}"}]) for i in range(n)],
                  "reference": [None] * n})
    pq.write_table(t, path, row_group_size=row_group)
    return t


def _part(d, prompts, lo, hi, n=2, reject=()):
    rows = []
    for i in range(lo, hi):
        for j in range(n):
            sid = f"{i:064x}#{j}" if n > 1 else f"{i:064x}"
            bad = i in reject
            rows.append({"sample_id": sid, "source": "mine", "status": "rejected" if bad else "ok",
                         "reason": "too_long" if bad else None, "message": "m" if bad else None,
                         "prompt_token_ids": [1, 2], "completion_token_ids": [3, i, j],
                         "num_completion_tokens": 3, "finish_reason": "stop"})
    t = pa.Table.from_pylist(rows, schema=CONVERSATIONS_SCHEMA)
    pq.write_table(t, d / f"part-{lo:08d}.parquet")


def test_vectorised_ids_match_the_scalar_ones():
    ids = ["ab", "ab#0", "ab#12", "cd#3"]
    assert prompt_ids(pa.array(ids)).to_pylist() == [prompt_id(s) for s in ids]
    assert completion_indices(pa.chunked_array([ids])).to_pylist() == [completion_index(s) for s in ids]
    assert prompt_ids(pa.array([], pa.string())).to_pylist() == []


@pytest.mark.parametrize("limit", [None, 40])
def test_read_tasks_give_every_prompt_not_done_once_in_batch_blocks(tmp_path, limit):
    t = _prompts(tmp_path / "p.parquet", 100)
    done = pa.array([f"{i:064x}" for i in range(0, 100, 3)])
    src = ParquetRows([tmp_path / "p.parquet"], ["sample_id", "source", "messages", "reference"],
                      block_rows=8, exclude=done, limit=limit)
    blocks = list(src.iter_local())
    got = [s for b in blocks for s in b.column("sample_id").to_pylist()]
    first = t.slice(0, limit or 100).column("sample_id").to_pylist()
    want = [s for s in first if s not in set(done.to_pylist())]
    assert got == want and len(set(got)) == len(got)
    assert all(b.num_rows == 8 for b in blocks[:-1]) and 0 < blocks[-1].num_rows <= 8
    assert count_not_in(tmp_path / "p.parquet", done, limit) == len(want)


def test_consolidate_from_compacted_parts_is_prompt_ordered_and_complete(tmp_path, monkeypatch):
    from eagle_ray.generate import run

    monkeypatch.setattr(run, "CONSOLIDATE_CHUNK", 5)  # many chunks, parts spanning chunks
    prompts = tmp_path / "p.parquet"
    _prompts(prompts, 30)
    out = tmp_path / "gen"
    parts = out / run.PARTS_DIR
    parts.mkdir(parents=True)
    # parts written out of prompt order (as replicas finish), one prompt rejected
    for lo, hi in [(20, 24), (0, 4), (8, 12), (4, 8), (12, 16), (24, 30)]:
        _part(parts, prompts, lo, hi, reject={9})
    params = {"sampling": {"samples_per_prompt": 2}}
    import vllm  # noqa: F401  (consolidate records its version)

    counts = run.consolidate(out, prompts, params)
    assert counts == {"prompts": 30, "samples_per_prompt": 2, "ok": 50, "rejected": 2, "pending": 8,
                      "pending_prompts": 4}
    conv = pq.read_table(out / run.CONVERSATIONS_FILE)
    ids = conv.column("sample_id").to_pylist()
    want = [f"{i:064x}#{j}" for i in range(30) if not 16 <= i < 20 and i != 9 for j in range(2)]
    assert ids == want
    assert conv.column("completion_token_ids").to_pylist()[:2] == [[3, 0, 0], [3, 0, 1]]
    rejects = [json.loads(l) for l in (out / run.REJECTS_FILE).read_text().splitlines()]
    assert [r["sample_id"] for r in rejects] == [f"{9:064x}#0", f"{9:064x}#1"]
    m = json.loads((out / run.MANIFEST_FILE).read_text())
    assert m["completion_tokens"] == 150 and m["finish_reasons"] == {"stop": 50}

    # compaction (in a process killed right after its switch) changes nothing of it
    code = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from eagle_ray.generate import run
        from eagle_ray.store import compact
        real = os.replace
        def replace(a, b):
            real(a, b)
            os._exit(9)  # the switch happened; the replaced parts are still there
        os.replace = replace
        compact.COMPACT_EVERY_PARTS = 2
        run.compact_parts(Path({str(parts)!r}))
    """)
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    assert list(parts.glob("compact-*.parquet")) and len(list(parts.glob("part-*.parquet"))) == 6
    assert len(run.done_prompts(parts)) == 26  # each row read once; leftovers finished
    assert len(list(parts.glob("part-*.parquet"))) == 0
    assert run.consolidate(out, prompts, params) == counts
    assert pq.read_table(out / run.CONVERSATIONS_FILE).equals(conv)


def test_consolidate_refuses_parts_of_another_prompt_set(tmp_path):
    from eagle_ray.generate import run

    prompts = tmp_path / "p.parquet"
    _prompts(prompts, 10)
    parts = tmp_path / "gen" / run.PARTS_DIR
    parts.mkdir(parents=True)
    _part(parts, prompts, 8, 12, n=1)
    with pytest.raises(ValueError, match="2 samples that are not in these prompts"):
        run.consolidate(tmp_path / "gen", prompts, {"sampling": {"samples_per_prompt": 1}})


def test_one_completion_per_prompt_orders_by_numpy_search_as_the_arrow_lookup_does(tmp_path, monkeypatch):
    """n = 1 and ids of one width (ingest's) take the sorted-search path; it gives the
    positions, the prompt count and the duplicate finding of the general path."""
    import numpy as np

    from eagle_ray.generate import run

    monkeypatch.setattr(run, "CONSOLIDATE_CHUNK", 4)
    prompts = tmp_path / "p.parquet"
    _prompts(prompts, 40, row_group=6)
    out = tmp_path / "gen"
    parts = out / run.PARTS_DIR
    parts.mkdir(parents=True)
    for lo, hi in [(30, 36), (0, 5), (12, 20), (5, 12)]:
        _part(parts, prompts, lo, hi, n=1, reject={7, 31})
    ids = pa.chunked_array([c for _, t in run.read_parts(parts) for c in t.column("sample_id").chunks])
    ids = ids.combine_chunks()
    for limit in (None, 33):
        fast = run._ranks_by_search(ids, prompts, limit)
        slow = run._ranks_by_lookup(ids, prompts, limit)
        assert fast is not None
        assert np.array_equal(fast[0], slow[0]) and fast[1:] == slow[1:]
    assert (run._ranks_by_search(ids, prompts, 33)[0] < 0).sum() == 3  # prompts 33-35 beyond the limit
    # a repeated id is found by both; ids of several widths are left to the general path
    twice = pa.concat_arrays([ids, ids.slice(0, 1)])
    assert run._ranks_by_search(twice, prompts, None)[2] and run._ranks_by_lookup(twice, prompts, None)[2]
    assert run._ranks_by_search(pa.array(["ab", "abc"]), prompts, None) is None

    import vllm  # noqa: F401  (consolidate records its version)

    counts = run.consolidate(out, prompts, {"sampling": {"samples_per_prompt": 1}})
    assert counts == {"prompts": 40, "samples_per_prompt": 1, "ok": 24, "rejected": 2, "pending": 14,
                      "pending_prompts": 14}
    want = [f"{i:064x}" for i in list(range(20)) + list(range(30, 36)) if i not in (7, 31)]
    assert pq.read_table(out / run.CONVERSATIONS_FILE).column("sample_id").to_pylist() == want
    rejects = [json.loads(l)["sample_id"] for l in (out / run.REJECTS_FILE).read_text().splitlines()]
    assert rejects == [f"{7:064x}", f"{31:064x}"]


def test_consolidate_orders_every_turn_of_a_session_whatever_its_count(tmp_path):
    """data.train_turns=all regenerating: a session has as many samples as turns (here 1 to
    12), ids `<prompt>#<k>`; the table is in prompt order, then k as a number (#10 after #9),
    and a prompt with no part yet is pending."""
    from eagle_ray.generate import run

    prompts = tmp_path / "p.parquet"
    _prompts(prompts, 10)
    parts = tmp_path / "gen" / run.PARTS_DIR
    parts.mkdir(parents=True)
    turns = {i: 1 + (5 * i) % 12 for i in range(10)}
    for i in (7, 2, 0, 9, 4, 1, 8, 3, 5):  # prompt 6 not done
        rows = [{"sample_id": f"{i:064x}#{k}", "source": "mine", "status": "ok",
                 "prompt_token_ids": [1], "completion_token_ids": [i, k], "num_completion_tokens": 2,
                 "finish_reason": "stop"} for k in reversed(range(turns[i]))]
        pq.write_table(pa.Table.from_pylist(rows, schema=CONVERSATIONS_SCHEMA), parts / f"part-{i}.parquet")
    import vllm  # noqa: F401  (consolidate records its version)

    counts = run.consolidate(tmp_path / "gen", prompts,
                             {"sampling": {"samples_per_prompt": 1}, "train_turns": "all"})
    want = [f"{i:064x}#{k}" for i in range(10) if i != 6 for k in range(turns[i])]
    assert max(turns.values()) >= 11
    assert pq.read_table(tmp_path / "gen" / run.CONVERSATIONS_FILE).column("sample_id").to_pylist() == want
    assert counts["ok"] == len(want) and counts["pending_prompts"] == 1 and counts["pending"] is None
