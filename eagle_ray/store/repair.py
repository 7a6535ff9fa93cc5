"""`eagle-ray store repair`: every failed `store verify` has a way back.

Under the store's exclusive lock (no extraction may run meanwhile):

    1. read every index part (an unreadable part is dropped whole)
    2. check every row: shard present and readable, rows in bounds, checksum
    3. of a sample id committed more than once, keep the first copy that verifies
    4. rewrite each index part that loses rows (tmp -> fsync -> rename; an emptied part is
       unlinked), so the index never points at anything removed in step 5
    5. remove shards no kept row points at (orphans, damaged shards) and temporary files
    6. bytes of a shard no kept row owns (a lost index part, all of a segment's samples
       dropped): cut off at the end of the shard, recorded in STORE/dropped.json elsewhere,
       so verify knows them from a lost part

Every step is a single atomic rename or unlink; a repair killed at any point leaves a
store whose index is consistent, and running repair again finishes the job. Dropped
samples are not in the index any more, so `eagle-ray extract` redoes exactly them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_ray.common.atomic import AtomicFile, fsync_dir
from eagle_ray.store.format import (INDEX_DIR, SHARDS_DIR, sample_checksum, stored_tensors,
                                    tensor_bytes)
from eagle_ray.store.lock import store_lock
from eagle_ray.store.reader import StoreDamagedError, read_index_part, read_manifest

logger = logging.getLogger(__name__)


def _row_checker(root: Path, manifest):
    """check(row) -> None if the row's bytes are intact, else the reason."""
    from eagle_ray.store.segments import ShardFiles

    files = ShardFiles(root / SHARDS_DIR, max_open=8)
    segments: dict[tuple[str, int], Any] = {}
    expected = stored_tensors(manifest.dtype)

    def segment(name: str, offset: int):
        key = (name, offset)
        if key not in segments:
            if not (root / SHARDS_DIR / name).exists():
                segments[key] = "missing shard"
            else:
                try:
                    seg = files.segment(name, offset)
                    segments[key] = seg if set(seg.keys()) == expected else "unexpected tensors"
                except Exception as e:  # truncated / overwritten
                    segments[key] = f"unreadable shard ({e})"
        return segments[key]

    def check(r: dict) -> str | None:
        seg = segment(r["shard"], r["shard_offset"])
        if isinstance(seg, str):
            return f"{seg} {r['shard']}"
        a, n = r["offset"], r["num_tokens"]
        if a < 0 or a + n > seg.shape("input_ids")[0]:
            return f"rows out of bounds in {r['shard']}"
        try:
            got = sample_checksum([tensor_bytes(seg.rows(k, a, a + n)) for k in sorted(expected)])
        except Exception as e:
            return f"unreadable rows in {r['shard']} ({e})"
        return None if got == r["checksum"] else f"checksum mismatch in {r['shard']}"

    return check


def _settle_layout(root: Path) -> int:
    """Step 6; returns the bytes dropped. Runs after every temporary file is gone, so each
    gap or tail the layout finds is owned by no write at all."""
    from eagle_ray.common.atomic import atomic_write_json
    from eagle_ray.store.format import DROPPED_FILE
    from eagle_ray.store.reader import layout, read_dropped

    lay = layout(root)
    before = read_dropped(root)
    dropped = {k: list(v) for k, v in before.items()}
    total = 0
    for name, ranges in lay.gaps.items():
        path = root / SHARDS_DIR / name
        size = path.stat().st_size
        for a, b in ranges:
            total += b - a
            if b == size:
                with open(path, "r+b") as f:
                    f.truncate(a)
                    os.fsync(f.fileno())
            else:
                dropped.setdefault(name, []).append([a, b])
    dropped = {k: v for k, v in dropped.items() if (root / SHARDS_DIR / k).exists()}
    if dropped != before:
        atomic_write_json(root / DROPPED_FILE, dropped)
    return total


def _rewrite_part(path: Path, table: pa.Table) -> None:
    if table.num_rows == 0:
        path.unlink()
        return
    # The store's own temporary name (readers and repair know `.part-*.tmp`); the directory
    # is fsynced once by the caller.
    f = AtomicFile(path, tmp=path.with_name(f".{path.name}.tmp"))
    try:
        pq.write_table(table, f.f, compression="snappy")
        f.commit(sync_dir=False)
    except BaseException:
        f.abort()
        raise


def repair_store(root: str | Path, *, dry_run: bool = False) -> dict[str, Any]:
    """Drop duplicate commits (keeping the first verified copy), damaged samples, unreadable
    index parts, orphan shards and temporary files. Returns what was (or would be) done."""
    root = Path(root)
    manifest = read_manifest(root)  # an unreadable manifest cannot be repaired: it says how
    from eagle_ray.store.compact import compaction_lock

    with store_lock(root, exclusive=True, command="eagle-ray store repair"), \
            compaction_lock(root, blocking=True):  # no compaction reads a part being rewritten
        check = _row_checker(root, manifest)
        kept_ids: set[str] = set()
        referenced: set[str] = set()
        report: dict[str, Any] = {"store": str(root), "dry_run": dry_run, "duplicates_dropped": 0,
                                  "damaged_dropped": [], "parts_dropped": [], "parts_rewritten": [],
                                  "shards_removed": [], "temp_files_removed": [],
                                  "bytes_dropped": 0}
        rewrites: list[tuple[Path, pa.Table | None]] = []
        from eagle_ray.store.compact import finish_compactions, live_index_files

        if not dry_run:
            finish_compactions(root)  # a compaction a crash interrupted: drop what it replaced
        for part in live_index_files(root):
            try:
                table = read_index_part(part)
            except StoreDamagedError as e:
                logger.warning("repair: dropping %s", e)
                report["parts_dropped"].append(part.name)
                rewrites.append((part, None))
                continue
            keep = []
            for r in table.to_pylist():
                if r["sample_id"] in kept_ids:
                    report["duplicates_dropped"] += 1
                    keep.append(False)
                    continue
                reason = check(r)
                if reason is not None:
                    report["damaged_dropped"].append(f"{r['sample_id']}: {reason}")
                    keep.append(False)
                    continue
                kept_ids.add(r["sample_id"])
                referenced.add(r["shard"])
                keep.append(True)
            if not all(keep):
                report["parts_rewritten"].append(part.name)
                rewrites.append((part, table.filter(pa.array(keep, pa.bool_()))))
        shards = sorted(p for p in (root / SHARDS_DIR).glob("shard-*.safetensors")
                        if p.name not in referenced)
        temps = sorted(p for d in (SHARDS_DIR, INDEX_DIR) for p in (root / d).glob(".*.tmp*"))
        report["shards_removed"] = [p.name for p in shards]
        report["temp_files_removed"] = [p.name for p in temps]
        report["samples"] = len(kept_ids)
        if dry_run:
            return report
        for part, table in rewrites:  # the index first: it never points at a removed shard
            if table is None:
                part.unlink()
            else:
                _rewrite_part(part, table)
        fsync_dir(root / INDEX_DIR)
        for p in shards + temps:
            p.unlink(missing_ok=True)
        fsync_dir(root / SHARDS_DIR)
        fsync_dir(root / INDEX_DIR)
        report["bytes_dropped"] = _settle_layout(root)
    logger.info("repair %s: kept %d samples; dropped %d duplicate and %d damaged row(s), %d "
                "index part(s); removed %d shard(s), %d temporary file(s)", root, len(kept_ids),
                report["duplicates_dropped"], len(report["damaged_dropped"]),
                len(report["parts_dropped"]), len(shards), len(temps))
    return report
