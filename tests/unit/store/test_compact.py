"""Index compaction: fewer files, every committed sample read exactly once before, during
and after a compaction, across a kill -9 at any point of it; old stores convert in place."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagle_ray.store.compact import compact, finish_compactions, live_index_files
from eagle_ray.store.reader import HiddenStateStore, read_index, verify_store

sys.path.insert(0, str(Path(__file__).parent))
from test_store import StoreWriter, manifest, samples  # noqa: E402


def _store(root, writes=6, per=2):
    w = StoreWriter(root, manifest(), compact_every=0)  # today's layout: one part per write
    for i in range(writes):
        w.write_shard(samples(per, seed=i))
    return {f"s{i}-{j}" for i in range(writes) for j in range(per)}


def _ids(root):
    return read_index(root).column("sample_id").to_pylist()


def test_store_compact_converts_an_old_store_in_place(tmp_path):
    want = _store(tmp_path)
    assert len(list((tmp_path / "index").glob("part-*.parquet"))) == 6
    before = HiddenStateStore(tmp_path).get("s3-1")
    res = compact(tmp_path, everything=True)
    assert res == {"merged": 6, "rows": 12}
    files = live_index_files(tmp_path)
    assert [p.name.split("-")[0] for p in files] == ["compact"] and not list((tmp_path / "index").glob("part-*"))
    ids = _ids(tmp_path)
    assert sorted(ids) == sorted(want) and len(ids) == len(set(ids))
    after = HiddenStateStore(tmp_path).get("s3-1")
    assert all((before[k] == after[k]).all() for k in before)
    assert verify_store(tmp_path)["ok"]
    # more writes after a compaction: new parts stay live beside the compact file, and a
    # second full compaction merges them with it
    w = StoreWriter(tmp_path, manifest(), compact_every=0)
    w.write_shard(samples(2, seed=50))
    assert len(set(_ids(tmp_path))) == 14 == len(_ids(tmp_path))
    compact(tmp_path, everything=True)
    assert len(live_index_files(tmp_path)) == 1 and len(_ids(tmp_path)) == 14
    assert verify_store(tmp_path, checksums=True)["ok"]


def test_writer_compacts_every_n_commits(tmp_path):
    w = StoreWriter(tmp_path, manifest(), compact_every=4)
    for i in range(10):
        w.write_shard(samples(1, seed=i))
    names = [p.name for p in live_index_files(tmp_path)]
    assert len(names) == 4 and sum(n.startswith("compact-") for n in names) == 2, names
    assert sorted(_ids(tmp_path)) == sorted(f"s{i}-0" for i in range(10))


@pytest.mark.parametrize("stage", ["tmp_written", "switched", "half_cleaned"])
def test_every_crash_point_reads_each_sample_once(tmp_path, stage):
    """The three states a kill can leave: the temporary file only, the compact file beside
    all it replaces, or beside some of them. Readers see every sample once in each; the
    next compaction (or repair) finishes the job."""
    want = _store(tmp_path)
    parts = sorted((tmp_path / "index").glob("part-*.parquet"))
    real_unlink, real_replace = Path.unlink, os.replace

    class Died(Exception):
        pass

    def replace(a, b):
        if stage == "tmp_written":
            raise Died
        real_replace(a, b)

    calls = []

    def unlink(self, missing_ok=False):
        if self.name.startswith("part-"):
            calls.append(self.name)
            if stage == "switched" or len(calls) > 3:
                raise Died
        real_unlink(self, missing_ok=missing_ok)

    import eagle_ray.store.compact as mod

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mod.os, "replace", replace)
        mp.setattr(Path, "unlink", unlink)
        if stage == "tmp_written":  # the cleanup of a failed write removes the tmp: keep one
            mp.setattr(Path, "unlink", lambda self, missing_ok=False: None)
        with pytest.raises(Died):
            compact(tmp_path, everything=True)
    ids = _ids(tmp_path)
    assert sorted(ids) == sorted(want) and len(ids) == len(want), stage
    rep = verify_store(tmp_path)
    assert rep["ok"] and rep["samples"] == 12, rep
    left = {p.name for p in parts if p.exists()}
    assert {"tmp_written": 6, "switched": 6, "half_cleaned": 3}[stage] == len(left)
    compact(tmp_path, everything=True)
    assert sorted(_ids(tmp_path)) == sorted(want) and len(live_index_files(tmp_path)) == 1
    assert not [p for p in parts if p.exists()]


def test_kill_9_during_compactions_then_rerun(tmp_path):
    """A real process compacting in a loop while a writer keeps committing, killed with
    SIGKILL mid-way; then a re-run: every committed sample exactly once, verify OK."""
    import signal
    import time

    _store(tmp_path, writes=20, per=1)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_store import StoreWriter, manifest, samples
        from eagle_ray.store.compact import compact
        w = StoreWriter({str(tmp_path)!r}, manifest(), compact_every=3)
        i = 100
        while True:
            w.write_shard(samples(1, seed=i)); i += 1
            print(i, flush=True)
            compact({str(tmp_path)!r}, everything=(i % 5 == 0))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    lines = []
    deadline = time.time() + 60
    while len(lines) < 25 and time.time() < deadline:
        lines.append(proc.stdout.readline())
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    committed = set(_ids(tmp_path))
    ids = _ids(tmp_path)
    assert len(ids) == len(committed) >= 20 + 25, len(ids)
    assert {f"s{i}-0" for i in range(20)} <= committed
    assert {f"s{i}-0" for i in range(100, 125)} <= committed  # each printed after its commit
    assert verify_store(tmp_path)["ok"]
    finish_compactions(tmp_path)
    compact(tmp_path, everything=True)
    assert sorted(_ids(tmp_path)) == sorted(committed) and verify_store(tmp_path, checksums=True)["ok"]


def test_writer_compaction_is_tiered_keeps_commit_order_and_few_files(tmp_path, monkeypatch):
    """Writers compacting every few commits never merge everything: compact files are merged
    MERGE_COMPACTS_AT neighbours at a time, the smallest run first, so each row is rewritten
    a logarithmic number of times, the live files stay few, and rows read back in commit
    order (the first copy of a retried write stays the one readers see)."""
    import pyarrow.parquet as pq

    from eagle_ray.store import compact as c

    rewritten = []
    real = pq.write_table

    def counting(table, where, **kw):
        rewritten.append(table.num_rows)
        return real(table, where, **kw)

    monkeypatch.setattr(pq, "write_table", counting)
    w = StoreWriter(tmp_path, manifest(), compact_every=2)
    order = []
    for i in range(400):
        w.write_shard(samples(1, seed=i))
        order.append(f"s{i}-0")
    compact_rows = sum(rewritten) - 400  # less each write's own index part
    live = live_index_files(tmp_path)
    assert _ids(tmp_path) == order
    assert len(live) <= 3 * c.MERGE_COMPACTS_AT, [p.name for p in live]
    assert sum(p.name.startswith("part-") for p in live) <= 1  # parts merged on every turn
    # everything-merges would rewrite ~400 * 400 / (2 * 8 * 2) = 5,000 rows; tiers ~400 * 4
    assert compact_rows < 2500, compact_rows
    assert verify_store(tmp_path)["ok"]


def test_a_read_during_another_process_compaction_sees_every_sample_once(tmp_path, monkeypatch):
    """Both ways a compaction that switches while a reader reads can fool a plain listing:
    a listed part unlinked before it is read (the live-scaling test's crash), and a switch
    between the listing's glob of compact files and its glob of parts (the compact file
    unseen, the parts gone: rows silently missing). `read_index` reads again after either."""
    import eagle_ray.store.compact as C

    want = _store(tmp_path)
    real_read, real_glob = C.read_index_part, Path.glob
    state = {"compacted": False}

    def compact_once(everything):
        if not state["compacted"]:
            state["compacted"] = True
            # as a writer in another process would
            assert compact(tmp_path, everything=everything)["merged"] >= 2

    # 1. the part this reader is about to read goes away under it
    def read_then_lose(p):
        if p.name.startswith("part-"):
            compact_once(everything=True)
        return real_read(p)

    monkeypatch.setattr(C, "read_index_part", read_then_lose)
    monkeypatch.setattr("eagle_ray.store.reader.read_index_part", read_then_lose)
    ids = _ids(tmp_path)
    assert state["compacted"] and sorted(ids) == sorted(want) and len(ids) == len(want)

    # 2. the switch lands between the listing's two globs (parts merged, the compact file
    # listed before stays live: nothing the listing holds goes missing, so nothing fails)
    w = StoreWriter(tmp_path, manifest(), compact_every=0)
    for seed in (60, 61):
        w.write_shard(samples(2, seed=seed))
    want |= {"s60-0", "s60-1", "s61-0", "s61-1"}
    state["compacted"] = False

    def glob(self, pattern):
        if pattern == "part-*.parquet":
            compact_once(everything=False)
        return real_glob(self, pattern)

    monkeypatch.setattr(C, "read_index_part", real_read)
    monkeypatch.setattr("eagle_ray.store.reader.read_index_part", real_read)
    monkeypatch.setattr(Path, "glob", glob)
    ids = _ids(tmp_path)
    assert state["compacted"] and sorted(ids) == sorted(want) and len(ids) == len(want)


def test_a_missing_part_with_no_compaction_is_still_damage(tmp_path):
    from eagle_ray.store.format import StoreDamagedError

    _store(tmp_path)
    part = sorted((tmp_path / "index").glob("part-*.parquet"))[2]
    part.write_bytes(b"not parquet")
    with pytest.raises(StoreDamagedError, match="unreadable"):
        read_index(tmp_path)
