"""Byte-sized shards (store/segments.py): writes append segments to one file per writer
until it holds storage.shard_bytes; a kill between append and commit leaves a tail that is
an interrupted write; stores of one shard per write (before segments) still read."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from eagle_ray.store.compact import compact
from eagle_ray.store.reader import HiddenStateStore, check_store_whole, read_index, verify_store
from eagle_ray.store.writer import StoreWriter, sweep_interrupted
from test_store import manifest, samples


def _assert_reads_back(root, written):
    store = HiddenStateStore(root)
    assert sorted(store.sample_ids) == sorted(s.sample_id for s in written)
    for s in written:
        got = store.get(s.sample_id, verify=True, dtype=torch.bfloat16)
        assert torch.equal(got["aux"], s.aux.to(torch.bfloat16))
        assert torch.equal(got["final"], s.final.to(torch.bfloat16))
        assert got["input_ids"].tolist() == s.input_ids.tolist()


def test_writes_append_to_one_shard_until_shard_bytes(tmp_path):
    one = StoreWriter(tmp_path / "probe", manifest())
    one.write_shard(samples(2))
    seg_bytes = next((tmp_path / "probe" / "shards").iterdir()).stat().st_size

    w = StoreWriter(tmp_path / "s", manifest(), shard_bytes=int(seg_bytes * 3.5))
    written = []
    for k in range(7):
        batch = samples(2, seed=k)
        w.write_shard(batch)
        written += batch
    shards = sorted((tmp_path / "s" / "shards").iterdir())
    assert len(shards) == 3  # 3 + 3 + 1 segments of about seg_bytes each
    idx = read_index(tmp_path / "s")
    assert len(set(idx.column("shard").to_pylist())) == 3
    offsets = sorted(set(zip(idx.column("shard").to_pylist(), idx.column("shard_offset").to_pylist())))
    assert [o for name, o in offsets if name == shards[0].name][0] == 0
    assert len([o for name, o in offsets if name == shards[0].name]) == 3
    rep = verify_store(tmp_path / "s")
    assert rep["ok"] and rep["samples"] == 14 and rep["shards"] == 3 and not rep["interrupted"], rep
    _assert_reads_back(tmp_path / "s", written)


def test_a_segment_damaged_in_the_middle_of_a_shard_is_found_and_repaired(tmp_path):
    from eagle_ray.store.repair import repair_store

    w = StoreWriter(tmp_path, manifest(), shard_bytes=1 << 30)
    batches = [samples(2, seed=k) for k in range(3)]
    for b in batches:
        w.write_shard(b)
    idx = read_index(tmp_path).to_pylist()
    mid = next(r for r in idx if r["sample_id"] == batches[1][0].sample_id)
    shard = tmp_path / "shards" / mid["shard"]
    data = bytearray(shard.read_bytes())
    data[-40] ^= 0xFF  # a byte of the last segment's loss_mask/input_ids
    end = len(data)
    hdr = int.from_bytes(data[mid["shard_offset"]:mid["shard_offset"] + 8], "little")
    pos = mid["shard_offset"] + 8 + hdr + 4  # a byte of the middle segment's first tensor
    data[pos] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert len(data) == end
    assert check_store_whole(tmp_path)["samples"] == 6  # structure intact: headers read
    rep = verify_store(tmp_path)
    bad = sorted(p.split(":")[0] for p in rep["problems"])
    assert not rep["ok"] and "@ byte" in rep["problems"][0] and len(bad) >= 2, rep
    fixed = repair_store(tmp_path)
    assert fixed["shards_removed"] == [] and len(fixed["damaged_dropped"]) == len(bad)
    rep = verify_store(tmp_path)
    assert rep["ok"] and rep["samples"] == 6 - len(bad), rep


def test_kill_between_append_and_commit_leaves_a_tail_that_the_sweep_cuts(tmp_path):
    """A real process appends a segment and dies right before its commit rename: the store
    reads whole, the shard is named as an interrupted write, the next exclusive writer
    truncates it to its last commit, and later writes (another writer) land normally."""
    first = samples(2)
    StoreWriter(tmp_path, manifest(), writer_id="w0", shard_bytes=1 << 30).write_shard(first)
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_store import StoreWriter, manifest, samples
        w = StoreWriter({str(tmp_path)!r}, manifest(), writer_id="w1", shard_bytes=1 << 30)
        w.write_shard(samples(2, seed=1))  # a new shard (committed)
        os.replace = lambda a, b: os._exit(9)  # the next rename is the append's commit
        w.write_shard(samples(3, seed=2))
    """)
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    shard = tmp_path / "shards" / "shard-w1-00000.safetensors"
    size_killed = shard.stat().st_size
    rep = verify_store(tmp_path)
    assert rep["ok"] and rep["samples"] == 4 and "shard-w1-00000.safetensors" in rep["interrupted"], rep
    assert check_store_whole(tmp_path)["samples"] == 4
    _assert_reads_back(tmp_path, first + samples(2, seed=1))
    swept = sweep_interrupted(tmp_path)
    assert "shard-w1-00000.safetensors" in swept and shard.stat().st_size < size_killed
    rep = verify_store(tmp_path)
    assert rep["ok"] and not rep["interrupted"], rep
    later = samples(3, seed=2)
    StoreWriter(tmp_path, manifest(), writer_id="w2", shard_bytes=1 << 30).write_shard(later)
    _assert_reads_back(tmp_path, first + samples(2, seed=1) + later)


def test_a_store_of_one_shard_per_write_without_shard_offsets_reads_and_compacts(tmp_path):
    """Index parts written before segments have no shard_offset column: their shards are
    one segment at byte 0. They read, verify, and `store compact` rewrites them in place
    with the column."""
    w = StoreWriter(tmp_path, manifest(), compact_every=0)
    written = []
    for k in range(4):
        batch = samples(2, seed=k)
        w.write_shard(batch)
        written += batch
    for part in (tmp_path / "index").glob("part-*.parquet"):
        t = pq.read_table(part)
        pq.write_table(t.drop(["shard_offset"]), part)  # what the older code wrote
    assert "shard_offset" not in pq.read_schema(next((tmp_path / "index").glob("part-*"))).names
    assert verify_store(tmp_path)["ok"]
    _assert_reads_back(tmp_path, written)
    assert compact(tmp_path, everything=True)["rows"] == 8
    files = list((tmp_path / "index").glob("*.parquet"))
    assert len(files) == 1 and "shard_offset" in pq.read_schema(files[0]).names
    assert verify_store(tmp_path)["ok"]
    _assert_reads_back(tmp_path, written)


def test_shard_bytes_must_be_positive():
    from eagle_ray.config import StorageConfig

    with pytest.raises(ValueError, match="shard_bytes"):
        StorageConfig(shard_bytes=0)


def test_a_lost_index_part_inside_a_shard_is_damage_and_repair_is_the_way_back(tmp_path):
    """With many writes per shard, losing an index part orphans no file: it leaves a segment
    no row references. Verify calls that damage (a gap in the shard, or bytes past its last
    commit without an uncommitted write); repair records the dropped bytes, so the repaired
    store verifies, and re-extraction adds the lost samples again."""
    from eagle_ray.store.format import StoreDamagedError
    from eagle_ray.store.repair import repair_store

    w = StoreWriter(tmp_path, manifest(), compact_every=0, shard_bytes=1 << 30)
    for k in range(4):
        w.write_shard(samples(2, seed=k))
    parts = sorted((tmp_path / "index").glob("part-*.parquet"))
    parts[1].unlink()  # a segment in the middle of the shard
    rep = verify_store(tmp_path)
    assert not rep["ok"] and any("no committed write" in p for p in rep["problems"]), rep
    with pytest.raises(StoreDamagedError, match="no committed write.*store repair"):
        check_store_whole(tmp_path)
    parts[3].unlink()  # the last segment: bytes past the last commit, no temporary part
    rep = verify_store(tmp_path)
    assert sum("no committed write" in p for p in rep["problems"]) == 2 and not rep["interrupted"], rep
    assert sweep_interrupted(tmp_path) == []  # damage is not swept away as a leftover
    fixed = repair_store(tmp_path)
    assert fixed["samples"] == 4 and fixed["bytes_dropped"] > 0, fixed
    rep = verify_store(tmp_path)
    assert rep["ok"] and rep["samples"] == 4, rep
    redo = samples(2, seed=1) + samples(2, seed=3)
    StoreWriter(tmp_path, manifest(), shard_bytes=1 << 30).write_shard(redo)
    rep = verify_store(tmp_path)
    assert rep["ok"] and rep["samples"] == 8, rep
    _assert_reads_back(tmp_path, samples(2, seed=0) + samples(2, seed=2) + redo)


def test_the_structural_check_needs_no_header_and_still_finds_truncation(tmp_path):
    """check_store_whole (what training runs first) reads the index and stats the shards:
    a truncated shard and a row that points past its segment are found without a header."""
    import pyarrow as pa

    from eagle_ray.store.format import StoreDamagedError

    w = StoreWriter(tmp_path, manifest(), compact_every=0, shard_bytes=1 << 30)
    for k in range(3):
        w.write_shard(samples(2, seed=k))
    shard = next((tmp_path / "shards").iterdir())
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(StoreDamagedError, match="truncated"):
        check_store_whole(tmp_path)
    shard.write_bytes(data)
    assert check_store_whole(tmp_path)["samples"] == 6
    part = sorted((tmp_path / "index").glob("part-*.parquet"))[0]
    t = pq.read_table(part)
    off = t.column("offset").to_pylist()
    off[-1] += 1000  # an index row past the end of its segment
    pq.write_table(t.set_column(t.schema.get_field_index("offset"), "offset",
                                pa.array(off, pa.int64())), part)
    with pytest.raises(StoreDamagedError, match="do not fit its segment"):
        check_store_whole(tmp_path)
