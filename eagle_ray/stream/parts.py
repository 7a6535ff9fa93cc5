"""The generated-conversation part both placements write: the streamed pipeline's record.

Separate pools call `write_part` as its own Ray Data task; the colocated replica calls it
between generating and capturing a batch. Either way the part is written atomically BEFORE
the batch's features can commit, so a committed sample always has its conversation on disk.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc


def write_part(batch: pa.Table, parts_dir: str, skip: pa.Array | None = None) -> pa.Table:
    """Ray Data task: write one generated batch as a part (atomic); return its ok rows,
    reduced to the columns extraction reads, less `skip` (samples already in the store whose
    part was lost: generated again for the record, not extracted twice)."""
    from eagle_ray.extract.stage import CAPTURE_COLUMNS
    from eagle_ray.generate.stage import CONVERSATIONS_SCHEMA
    from eagle_ray.common.atomic import atomic_write_parquet

    if batch.num_rows == 0:
        return batch.cast(CONVERSATIONS_SCHEMA).select(list(CAPTURE_COLUMNS))
    batch = batch.cast(CONVERSATIONS_SCHEMA)
    atomic_write_parquet(Path(parts_dir) / f"part-{time.time_ns()}-{uuid.uuid4().hex[:8]}.parquet", batch)
    ok = pc.equal(batch.column("status"), "ok")
    if skip is not None and len(skip):
        ok = pc.and_(ok, pc.invert(pc.is_in(batch.column("sample_id"), value_set=skip)))
    return batch.filter(ok).select(list(CAPTURE_COLUMNS))


class RejectedRows:
    """Callable: how many rows the live generation parts of `parts_dir` hold with a status
    other than ok (rejected: each is a sample the run will not commit). The driver's
    progress polls it so a streamed run's percentage and ETA count rejected samples as done.
    Each live file is read once (its status column); a compaction's new file replaces the
    parts it merged, so the sum stays right. A file that does not read counts 0 here (resume
    bookkeeping deals with damage)."""

    def __init__(self, parts_dir: str | Path):
        self.parts_dir = Path(parts_dir)
        self._counts: dict[str, int] = {}

    def __call__(self) -> int:
        import pyarrow.parquet as pq

        from eagle_ray.store.compact import live_files

        total = 0
        for f in live_files(self.parts_dir):
            n = self._counts.get(f.name)
            if n is None:
                try:
                    status = pq.ParquetFile(f).read(columns=["status"]).column("status")
                except (OSError, pa.ArrowException):
                    continue
                n = self._counts[f.name] = len(status) - (pc.sum(pc.equal(status, "ok")).as_py() or 0)
            total += n
        return total
