"""Rows of Parquet files as a Ray Dataset the driver never holds: prompts, generation parts.

    prompts.parquet (ingest) ─▶ ParquetRows: read tasks over its row groups, less the sample
        ids in `exclude` (prompts already done) ─▶ streaming repartition into blocks of
        `block_rows` rows (one generation batch: replicas share the work from the start)
        ─▶ map_batches(...)

The driver reads Parquet metadata and the id columns it needs for resume bookkeeping, as
Arrow arrays (no Python object per sample); prompt texts and token lists are only ever read
by the read tasks, on the workers. `exclude` travels to the tasks through the object store
(one copy, however many tasks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_ray.data.ids import SEP


def prompt_ids(sample_ids: pa.Array | pa.ChunkedArray) -> pa.Array:
    """`ids.prompt_id` of every id, vectorised: the text before the first separator (the
    array itself when no id has one: one completion per prompt)."""
    arr = sample_ids.combine_chunks() if isinstance(sample_ids, pa.ChunkedArray) else sample_ids
    if len(arr) == 0:
        return pa.array([], pa.string())
    if not pc.any(pc.match_substring(arr, SEP)).as_py():
        return arr
    return pc.replace_substring_regex(arr, SEP + ".*$", "")


def fixed_width(arr: pa.Array):
    """A string array whose values all have one byte length w (and no NUL byte) as a
    zero-copy numpy `S<w>` view, so that sorting and searching are numpy's; else None."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    n = len(arr)
    if n == 0 or arr.null_count or arr.type != pa.string():
        return None
    offs = np.frombuffer(arr.buffers()[1], np.int32, n + 1, arr.offset * 4)
    w = int(offs[1] - offs[0])
    if w <= 0 or int(offs[-1] - offs[0]) != w * n or np.any(np.diff(offs) != w):
        return None
    data = np.frombuffer(arr.buffers()[2], np.uint8)[offs[0]:offs[-1]]
    if not data.all():
        return None
    return data.view(f"S{w}")


def completion_indices(sample_ids: pa.Array | pa.ChunkedArray) -> pa.Array:
    """`ids.completion_index` of every id, vectorised (0 where there is no separator)."""
    arr = sample_ids.combine_chunks() if isinstance(sample_ids, pa.ChunkedArray) else sample_ids
    if len(arr) == 0:
        return pa.array([], pa.int64())
    # "<p>" -> "<p>#0", "<p>#j" -> "<p>#j#0": the second field is j either way
    padded = pc.binary_join_element_wise(arr, "0", SEP)
    return pc.cast(pc.list_element(pc.split_pattern(padded, SEP, max_splits=2), 1), pa.int64())


def num_rows(path: Path, limit: int | None = None) -> int:
    n = pq.read_metadata(path).num_rows
    return n if limit is None else min(n, limit)


def iter_id_chunks(path: Path, limit: int | None = None,
                   column: str = "sample_id") -> Iterator[pa.Array]:
    """The id column of `path`'s first `limit` rows, a row group at a time."""
    f = pq.ParquetFile(path)
    left = f.metadata.num_rows if limit is None else limit
    for rg in range(f.num_row_groups):
        if left <= 0:
            return
        col = f.read_row_group(rg, columns=[column]).column(0).combine_chunks()
        col = col.slice(0, left)
        left -= len(col)
        yield col


def search_sorted(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of `values` is in the sorted `keys` (clipped to the last key) and whether
    it is there: the membership test of the sorted-id paths."""
    at = np.minimum(np.searchsorted(keys, values), len(keys) - 1)
    return at, keys[at] == values


def unique_ids(ids: pa.Array) -> pa.Array:
    """The distinct ids (in no particular order): numpy's sort for ids of one width (no
    hash table of a million strings), else Arrow's unique."""
    keys = fixed_width(ids)
    if keys is None:
        return pc.unique(ids)
    u = np.unique(keys)
    w = keys.dtype.itemsize
    return pa.Array.from_buffers(pa.string(), len(u), [
        None, pa.py_buffer(np.arange(0, (len(u) + 1) * w, w, dtype=np.int32)), pa.py_buffer(u.tobytes())])


def count_not_in(path: Path, exclude: pa.Array, limit: int | None = None) -> int:
    """How many of the first `limit` rows of `path` have an id not in `exclude` (ids of one
    width: `exclude` sorted once and searched, numpy; else Arrow's is_in per row group)."""
    keys = fixed_width(exclude) if len(exclude) else None
    if keys is not None:
        keys = np.sort(keys)
    n = 0
    for ids in iter_id_chunks(path, limit):
        c = fixed_width(ids) if keys is not None else None
        if c is not None and c.dtype == keys.dtype:
            n += len(c) - int(np.count_nonzero(search_sorted(keys, c)[1]))
        else:
            n += len(ids) - (pc.sum(pc.is_in(ids, value_set=exclude)).as_py() or 0 if len(exclude) else 0)
    return n


def _read(units: list[tuple[str, int, int]], columns: list[str], block_rows: int, exclude,
          only_ok: bool, convert: Callable | None) -> Iterator[pa.Table]:
    """A read task: the rows of (file, row group, first n rows) units, filtered, re-blocked."""
    if exclude is not None and not isinstance(exclude, (pa.Array, pa.ChunkedArray)):
        import ray

        exclude = ray.get(exclude)
    read_cols = list(columns) + (["status"] if only_ok and "status" not in columns else [])
    pending: list[pa.Table] = []
    held = 0
    for path, rg, n in units:
        t = pq.ParquetFile(path).read_row_group(rg, columns=read_cols).slice(0, n)
        if only_ok:
            t = t.filter(pc.equal(t.column("status"), "ok"))
        if exclude is not None and len(exclude) and t.num_rows:
            t = t.filter(pc.invert(pc.is_in(t.column("sample_id"), value_set=exclude)))
        t = t.select(list(columns))
        if not t.num_rows:
            continue
        pending.append(t)
        held += t.num_rows
        while held >= block_rows:
            whole = pa.concat_tables(pending).combine_chunks()
            yield convert(whole.slice(0, block_rows)) if convert else whole.slice(0, block_rows)
            rest = whole.slice(block_rows)
            pending, held = ([rest] if rest.num_rows else []), rest.num_rows
    if held:
        whole = pa.concat_tables(pending).combine_chunks()
        yield convert(whole) if convert else whole


def _datasource_base():
    from ray.data import Datasource

    return Datasource


class ParquetRows(_datasource_base()):
    """A Ray Data datasource: rows of Parquet files (in file, then row order) in blocks of
    `block_rows`, less rows whose sample_id is in `exclude` (an Arrow array or its ObjectRef),
    only status == "ok" rows with `only_ok`, the first `limit` rows, each block through
    `convert` (a module-level function) if given."""

    def __init__(self, files: list[Path], columns: list[str], *, block_rows: int,
                 exclude=None, only_ok: bool = False, limit: int | None = None,
                 convert: Callable | None = None):
        super().__init__()
        self.columns, self.block_rows = list(columns), block_rows
        self.exclude, self.only_ok, self.convert = exclude, only_ok, convert
        self.units: list[tuple[str, int, int]] = []  # (file, row group, rows to read)
        self.bytes = 0
        left = limit
        for f in files:
            md = pq.read_metadata(f)
            for rg in range(md.num_row_groups):
                n = md.row_group(rg).num_rows
                if left is not None:
                    if left <= 0:
                        break
                    n = min(n, left)
                    left -= n
                if n:
                    self.units.append((str(f), rg, n))
                    self.bytes += md.row_group(rg).total_byte_size * n // max(1, md.row_group(rg).num_rows)

    def estimate_inmemory_data_size(self) -> int:
        return self.bytes

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None):
        from ray.data.block import BlockMetadata
        from ray.data.datasource import ReadTask

        if not self.units:
            return []
        k = max(1, min(parallelism, len(self.units)))
        step = -(-len(self.units) // k)  # contiguous groups: a task reads neighbouring rows
        groups = [self.units[i:i + step] for i in range(0, len(self.units), step)]
        exclude = self.exclude
        if isinstance(exclude, (pa.Array, pa.ChunkedArray)) and len(exclude):
            import ray

            exclude = ray.put(exclude)  # one copy in the object store, not one per task
        tasks = []
        for g in groups:
            rows = sum(n for _, _, n in g)
            meta = BlockMetadata(num_rows=None, size_bytes=self.bytes * rows // max(1, self.total_rows),
                                 exec_stats=None, input_files=sorted({u[0] for u in g}))
            tasks.append(ReadTask(
                lambda g=g, c=self.columns, b=self.block_rows, x=exclude, o=self.only_ok,
                f=self.convert: _read(g, c, b, x, o, f),
                meta, per_task_row_limit=per_task_row_limit))
        return tasks

    @property
    def total_rows(self) -> int:
        return sum(n for _, _, n in self.units)

    def iter_local(self) -> Iterator[pa.Table]:
        """The blocks, read in this process (no Ray): tests and benchmarks."""
        yield from _read(self.units, self.columns, self.block_rows, self.exclude, self.only_ok,
                         self.convert)


def dataset(source: "ParquetRows"):
    """The Ray Dataset of a ParquetRows source, in blocks of `block_rows` rows. Ray Data's
    read operator merges what one read task yields into one block (up to
    target_max_block_size): without the streaming repartition a whole row group would reach
    one replica as one bundle, and the pool would not share the work."""
    import ray

    return ray.data.read_datasource(source).repartition(target_num_rows_per_block=source.block_rows)
