"""Index compaction: many small committed index parts -> few large index files, atomically.

Every write commits one index part (store/writer.py: the part is the commit record), so a
store of N writes has N parts and opening it costs N file reads. Compaction merges committed
files into one `index/compact-<id>.parquet` whose Parquet metadata names the files it
replaces (`eagle_ray.replaces`, transitively). The protocol:

    1. write index/.compact-<id>.parquet.tmp (every row of the inputs, in read order) -> fsync
    2. rename -> index/compact-<id>.parquet                    (the switch: one rename)
    3. unlink the replaced files, fsync the directory          (cleanup)

Readers (`live_index_files`) read every compact file's metadata and skip every file a live
compact file replaces, so at every instant each committed row is read exactly once: before
step 2 from the inputs, after it from the compact file, whatever of step 3 has happened. A
read takes time, so a reader of a directory another process compacts reads through
`read_live`, which reads again when a switch happened meanwhile. A
kill -9 before step 2 leaves a temporary file (an interrupted write, swept like the
writer's); after it, leftover replaced files that the next compaction, `store repair` or
`finish_compactions` removes. Parts committed while a compaction runs are not among its
inputs and stay live. One compaction at a time per store (an flock on index/.compact.lock;
a writer that finds it taken skips its turn). Sample ids are also deduplicated by readers
(first occurrence), so even two overlapping compactions could not show a sample twice.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_ray.common.atomic import fsync_dir
import numpy as np

from eagle_ray.store.format import INDEX_DIR, INDEX_SCHEMA, StoreDamagedError, repair_hint

logger = logging.getLogger(__name__)

REPLACES_KEY = b"eagle_ray.replaces"
LOCK_FILE = ".compact.lock"
# A writer compacts after this many of its own commits (if no other compaction runs), and
# compact files themselves are merged this many of one size tier at a time.
COMPACT_EVERY_PARTS = 64
MERGE_COMPACTS_AT = 8


def replaced_by(path: Path) -> list[str]:
    """The file names a compact file replaces (from its Parquet metadata)."""
    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta.get(REPLACES_KEY, b"[]"))


def read_index_part(path: Path) -> pa.Table:
    """One index file's rows in INDEX_SCHEMA. A file written before shards held several
    segments has no `shard_offset` / `segment_bytes`: each of its shards is one segment at
    byte 0, the whole file (-1)."""
    try:
        t = pq.read_table(path)
        for name, value in (("shard_offset", 0), ("segment_bytes", -1)):
            if name not in t.column_names:
                t = t.append_column(name, pa.array(np.full(t.num_rows, value, np.int64)))
        return t.select(INDEX_SCHEMA.names).cast(INDEX_SCHEMA).replace_schema_metadata(None)
    except (OSError, ValueError, KeyError, pa.ArrowException) as e:  # truncated / overwritten parquet
        raise StoreDamagedError(f"index part {path} is unreadable ({e}); "
                                f"{repair_hint(path.parent.parent)}") from None


def live_files(d: Path) -> list[Path]:
    """The committed files of directory d a reader must read: compact files (oldest first)
    then parts (by name), minus every file a live compact file replaces."""
    compacts = sorted(d.glob("compact-*.parquet"))
    replaced: set[str] = set()
    for c in compacts:
        replaced.update(replaced_by(c))
    return ([c for c in compacts if c.name not in replaced]
            + [p for p in sorted(d.glob("part-*.parquet")) if p.name not in replaced])


def _compact_names(d: Path) -> set[str]:
    return {c.name for c in d.glob("compact-*.parquet")}


def read_live(d: Path, read) -> list[pa.Table]:
    """`read(path)` of every live file of d, as one snapshot even while another process
    compacts d. A switch (step 2) between listing and reading can unlink a listed part
    before it is read, or land between `live_files`' two globs (its compact file unseen, the
    parts it replaced already gone: rows silently missing). Every switch leaves a compact
    name that was not there before (names are unique, and a compact file is only ever
    removed by a newer one), so a read during which the set of compact names did not change
    saw no switch; otherwise it is read again. A read that fails with no switch is damage."""
    for _ in range(1000):
        before = _compact_names(d)
        try:
            tables = [read(p) for p in live_files(d)]
        except (OSError, StoreDamagedError):
            if _compact_names(d) == before:
                raise
            continue
        if _compact_names(d) == before:
            return tables
    raise StoreDamagedError(f"{d}: compactions kept switching while its files were read "
                            f"(1000 tries)")


def live_index_files(root: str | Path) -> list[Path]:
    """The store's live index files (`live_files` of STORE/index)."""
    return live_files(Path(root) / INDEX_DIR)


def finish_dir(d: Path) -> list[str]:
    """Step 3 of compactions a crash interrupted: unlink files a live compact file replaces."""
    live = set(p.name for p in live_files(d))
    gone = []
    for c in sorted(d.glob("compact-*.parquet")):
        if c.name not in live:
            continue
        for name in replaced_by(c):
            p = d / name
            if p.exists():
                p.unlink()
                gone.append(name)
    if gone:
        fsync_dir(d)
    return gone


def finish_compactions(root: str | Path) -> list[str]:
    return finish_dir(Path(root) / INDEX_DIR)


def _tier_run(compacts: list[Path]) -> list[Path] | None:
    """MERGE_COMPACTS_AT neighbouring compact files of one size tier (rows within a factor
    MERGE_COMPACTS_AT), the smallest tier first, or None: merging only files of like size
    rewrites each row O(log n) times over a store's life (a merge of everything would
    rewrite it on every merge) and keeps ~MERGE_COMPACTS_AT files per tier."""
    import math

    k = MERGE_COMPACTS_AT
    if len(compacts) < k:
        return None
    tiers = [int(math.log(max(1, pq.read_metadata(c).num_rows), k)) for c in compacts]
    best = None
    for i in range(len(compacts) - k + 1):
        if len(set(tiers[i:i + k])) == 1 and (best is None or tiers[i] <= tiers[best]):
            best = i
    return None if best is None else compacts[best:best + k]


@contextmanager
def dir_lock(d: Path, blocking: bool) -> Iterator[bool]:
    """One compaction at a time in d (an flock on d/.compact.lock)."""
    fd = os.open(d / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def compaction_lock(root: Path, blocking: bool):
    return dir_lock(Path(root) / INDEX_DIR, blocking)


def compact(root: str | Path, *, everything: bool = False, blocking: bool = True,
            min_parts: int = 2) -> dict[str, int] | None:
    """Merge committed index files (module doc). MERGE_COMPACTS_AT compact files of one size
    tier are merged when there are (`_tier_run`), else parts into one new compact file when
    there are >= min_parts of them; everything into one file with `everything` (`store
    compact`). Returns {"merged",
    "rows"}, or None when another compaction holds the lock (blocking=False) or there was
    nothing to do."""
    return compact_dir(Path(root) / INDEX_DIR, read_index_part, INDEX_SCHEMA, what="index",
                       everything=everything, blocking=blocking, min_parts=min_parts)


def compact_dir(d: Path, read, schema: pa.Schema, *, what: str, everything: bool = False,
                blocking: bool = True, min_parts: int = 2, merge_compacts: bool = True,
                max_inputs: int | None = None,
                row_group_size: int | None = None) -> dict[str, int] | None:
    """`compact` for any directory of committed Parquet parts (the store's index, a
    generation run's parts): `read(path)` returns a file's rows in `schema`. Without
    `merge_compacts` only parts are merged (compact files of heavy rows stay the size of
    min_parts parts, so no compaction ever reads them all); `max_inputs` bounds the parts
    one compaction merges (the oldest first)."""
    with dir_lock(d, blocking) as got:
        if not got:
            return None
        finish_dir(d)
        live = live_files(d)
        compacts = [p for p in live if p.name.startswith("compact-")]
        parts = [p for p in live if p.name.startswith("part-")]
        done = []  # (files merged, rows) per merge
        if merge_compacts and everything:
            if len(compacts) + len(parts) < 2:
                return None
            done.append(_merge(d, compacts + parts, read, schema, time.time_ns(), row_group_size, what))
        else:
            if len(parts) >= min_parts:
                done.append(_merge(d, parts[:max_inputs] if max_inputs else parts, read, schema,
                                   time.time_ns(), row_group_size, what))
            while merge_compacts:
                run = _tier_run([p for p in live_files(d) if p.name.startswith("compact-")])
                if run is None:
                    break
                # The merged file takes the run's first name's time: files keep their order.
                done.append(_merge(d, run, read, schema, int(run[0].name.split("-")[1]),
                                   row_group_size, what))
    if not done:
        return None
    return {"merged": sum(m for m, _ in done), "rows": sum(r for _, r in done)}


def _merge(d: Path, inputs: list[Path], read, schema: pa.Schema, name_ns: int,
           row_group_size: int | None, what: str) -> tuple[int, int]:
    """One merge of `inputs` into a new compact file (the protocol of the module doc), under
    the directory's compaction lock. Returns (files merged, rows)."""
    replaces: list[str] = []
    tables = []
    for p in inputs:
        replaces.append(p.name)
        if p.name.startswith("compact-"):
            replaces.extend(replaced_by(p))
        tables.append(read(p))
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    # Names sort by creation time: "oldest first" stays true for readers.
    name = f"compact-{name_ns:020d}-{uuid.uuid4().hex[:8]}.parquet"
    tmp = d / f".{name}.tmp"
    meta = {**(schema.metadata or {}), REPLACES_KEY: json.dumps(sorted(set(replaces))).encode()}
    try:
        with open(tmp, "wb") as f:
            pq.write_table(table.cast(schema.with_metadata(meta)), f,
                           row_group_size=row_group_size)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / name)  # the switch
        fsync_dir(d)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finish_dir(d)
    logger.debug("%s: compacted %d %s file(s), %d rows -> %s", d, len(inputs), what, table.num_rows,
                name)
    return len(inputs), table.num_rows
