"""Reading the hidden-state store: index lookups and memory-mapped sample slices.

`HiddenStateStore(path)` validates the manifest (optionally against what the caller
expects), loads the committed index (all index parts; a sample id committed twice, which
only a retried write can cause, resolves to its first row), and returns a sample's tensors
by reading its rows from its shard segment (store/segments.py): only the sample's rows
are read, never the whole shard.
It works as a map-style torch Dataset (`store[i]`) and feeds Ray Data via `index_table()`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_ray.store.compact import read_index_part, read_live
from eagle_ray.store.format import (DROPPED_FILE, INDEX_DIR, INDEX_SCHEMA, MANIFEST_FILE,
                                    SCHEMA_VERSION, SHARDS_DIR, StoreDamagedError, StoreError,
                                    StoreManifest, repair_hint, sample_checksum, stored_tensors,
                                    tensor_bytes)
from eagle_ray.store.segments import ShardFiles, read_header


def read_manifest(root: str | Path) -> StoreManifest:
    path = Path(root) / MANIFEST_FILE
    if not path.exists():
        raise FileNotFoundError(f"{root} is not a hidden-state store (no {MANIFEST_FILE})")
    way_out = ("restore it from a copy of the store, or extract into a new store directory; "
               "the manifest cannot be rebuilt from the shards")
    try:
        d = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise StoreError(f"{path} is not valid JSON ({e}); {way_out}") from None
    if not isinstance(d, dict):
        raise StoreError(f"{path} holds a JSON {type(d).__name__}, not a store manifest; {way_out}")
    if d.get("schema_version") != SCHEMA_VERSION:
        raise StoreError(f"{root}: store schema_version {d.get('schema_version')} is not "
                         f"{SCHEMA_VERSION}, the version this eagle_ray reads")
    required = [f.name for f in dataclasses.fields(StoreManifest)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in d]
    if missing:
        raise StoreError(f"{path} lacks required key(s) {', '.join(missing)}; {way_out}")
    try:
        return StoreManifest.from_dict(d)
    except (TypeError, ValueError) as e:
        raise StoreError(f"{path} is not a valid store manifest ({e}); {way_out}") from None


def read_index(root: str | Path) -> pa.Table:
    """All committed index rows: live compact files, then parts no compact file replaces
    (store/compact.py); temporary files are not committed and are skipped."""
    d = Path(root) / INDEX_DIR
    tables = read_live(d, read_index_part) if d.exists() else []
    if not tables:
        return INDEX_SCHEMA.empty_table()
    return pa.concat_tables(tables)


def committed_ids(root: str | Path) -> pa.Array:
    """The distinct sample ids committed to the store (Arrow: a million ids are one array,
    not a set of a million strings); empty when the store has no index yet."""
    if not (Path(root) / INDEX_DIR).exists():
        return pa.array([], pa.string())
    return pc.unique(read_index(root).column("sample_id").combine_chunks())


def _first_occurrence(table: pa.Table) -> pa.Table:
    ids = table.column("sample_id")
    if pc.count_distinct(ids).as_py() == table.num_rows:
        return table
    seen, keep = set(), []
    for i, sid in enumerate(ids.to_pylist()):
        keep.append(sid not in seen)
        seen.add(sid)
    return table.filter(pa.array(keep))


class _LazyColumns(dict):
    """column name -> Python list of the index column, converted on first access."""

    def __init__(self, table: pa.Table) -> None:
        super().__init__()
        self._table = table

    def __missing__(self, name: str) -> list:
        values = self._table.column(name).to_pylist()
        self[name] = values
        return values


class HiddenStateStore:
    def __init__(self, root: str | Path, *, expect: StoreManifest | None = None,
                 max_open_shards: int = 64):
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        if expect is not None:
            diff = self.manifest.mismatches(expect)
            if diff:
                raise StoreError(f"{root} does not hold the expected features: " + "; ".join(
                    f"{k}: store {a!r} vs expected {b!r}" for k, (a, b) in diff.items()))
        self.index = _first_occurrence(read_index(self.root))
        # Columns as Python lists and the id -> row map are built on first use: opening a
        # store of a million samples costs reading its (compacted) index, not 1M objects.
        self._cols = _LazyColumns(self.index)
        self._row_of_map: dict[str, int] | None = None
        self._shards = ShardFiles(self.root / SHARDS_DIR, max_open_shards)
        self._verified: set[int] = set()  # rows whose checksum passed in this process

    def __len__(self) -> int:
        return self.index.num_rows

    @property
    def _row_of(self) -> dict[str, int]:
        if self._row_of_map is None:
            self._row_of_map = {sid: i for i, sid in enumerate(self._cols["sample_id"])}
        return self._row_of_map

    @property
    def sample_ids(self) -> list[str]:
        return self._cols["sample_id"]

    def num_tokens(self, sid: str) -> int:
        """One sample's token count (builds the id -> row map on first use)."""
        return self._cols["num_tokens"][self._row_of[sid]]

    def lengths(self, ids: Sequence[str]) -> list[int]:
        """Each id's token count, from the index (Arrow's lookup: no id -> row map of a
        million strings unless the store has built one already)."""
        if ids is self.sample_ids:
            return list(self._cols["num_tokens"])
        if self._row_of_map is not None:
            cols, row_of = self._cols["num_tokens"], self._row_of
            return [cols[row_of[s]] for s in ids]
        arr = pa.array(list(ids), pa.string())
        rows = pc.index_in(arr, value_set=self.index.column("sample_id"))
        if rows.null_count:
            raise KeyError(arr.filter(rows.is_null())[0].as_py())
        return self.index.column("num_tokens").take(rows).to_pylist()

    def index_table(self) -> pa.Table:
        return self.index

    def raw(self, key: int | str) -> dict[str, Any]:
        """The sample's stored tensors (storage dtype), read from its shard segment."""
        i = self._row_of[key] if isinstance(key, str) else int(key)
        name, off, n = self._cols["shard"][i], self._cols["offset"][i], self._cols["num_tokens"][i]
        try:
            seg = self._shards.segment(name, self._cols["shard_offset"][i])
            return {k: seg.rows(k, off, off + n) for k in seg.keys()}
        except (StoreDamagedError, OSError) as e:
            raise StoreDamagedError(f"{e}; {repair_hint(self.root)}") from None

    def get(self, key: int | str, *, verify: bool = False, dtype=None) -> dict[str, Any]:
        """{"input_ids" [T] int64, "loss_mask" [T] bool, "aux" [T, A*H], "final" [T, H]}
        decoded to `dtype` (default float32); `verify` checks the sample's checksum the first
        time this object reads it (later epochs re-read the same bytes: ~1.3 GB/s of blake2b
        per worker is paid once, bench/bench_store.py)."""

        raw = self.raw(key)
        i = self._row_of[key] if isinstance(key, str) else int(key)
        if verify and i not in self._verified:
            got = sample_checksum([tensor_bytes(raw[k]) for k in sorted(raw)])
            if got == self._cols["checksum"][i]:
                self._verified.add(i)
            else:
                raise StoreError(f"sample {self._cols['sample_id'][i]} fails its checksum in shard "
                                 f"{self.root / SHARDS_DIR / self._cols['shard'][i]} (corrupted "
                                 f"bytes); {repair_hint(self.root)}")
        return decode(raw, dtype)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.get(i)


def verify_store(root: str | Path, *, checksums: bool = True, headers: bool = True) -> dict[str, Any]:
    """Check every index row against its shard segment (exists, in bounds; with `headers`
    the segment's header read and matched to the manifest; with `checksums` every sample's
    bytes hashed) and find duplicates, lost index parts (orphan shards, bytes of a shard no
    committed write owns) and the leftovers of interrupted writes. Returns {"samples",
    "shards", "tokens", "problems", "orphans", "interrupted", "ok", "bytes_hashed",
    "seconds"}; `ok` is no damage (problems or orphans): interrupted writes hold nothing
    committed. Without headers it reads the index and stats each shard: under a second per
    million samples; headers add one small read per write."""
    import time

    t0 = time.perf_counter()
    root = Path(root)
    problems: list[str] = []
    manifest = read_manifest(root)
    index = read_index(root)
    n_ids = pc.count_distinct(index.column("sample_id")).as_py() if index.num_rows else 0
    dup = index.num_rows - n_ids
    if dup:
        problems.append(f"{dup} sample id(s) committed more than once")
    shards_on_disk = {p.name for p in (root / SHARDS_DIR).glob("shard-*.safetensors")}
    referenced = set(pc.unique(index.column("shard")).to_pylist()) if index.num_rows else set()
    for name in sorted(referenced - shards_on_disk):
        problems.append(f"index references missing shard {name}")
    problems += _rows_within_segments(index, manifest)
    hashed = 0
    if (headers or checksums) and index.num_rows:
        hashed = _check_segments(root, index, manifest, shards_on_disk, checksums, problems)
    lay = layout(root, index)
    problems += lay.problems
    paths, tails = interrupted_writes(root, referenced, lay)
    interrupted = [p.name for p in paths] + [p.name for p in tails]
    orphans = sorted(shards_on_disk - referenced - {p.name for p in paths})
    return {"store": str(root), "samples": n_ids, "shards": len(referenced),
            "tokens": int(pc.sum(index.column("num_tokens")).as_py() or 0),
            "problems": problems, "orphans": orphans, "interrupted": interrupted,
            "ok": not problems and not orphans, "bytes_hashed": hashed,
            "seconds": time.perf_counter() - t0}


def _where(name: str, seg_off: int) -> str:
    """How a problem names a segment: the shard, and the byte it starts at unless 0."""
    return f"{name}" + (f" @ byte {seg_off}" if seg_off else "")


def _check_segments(root: Path, index: pa.Table, manifest: StoreManifest, shards_on_disk: set[str],
                    checksums: bool, problems: list[str]) -> int:
    """Read each segment's header (with `checksums` also hash its rows), appending what is
    wrong to `problems`; returns the bytes hashed."""
    expected_keys = stored_tensors(manifest.dtype)
    offsets = index.column("offset").to_numpy()
    ntok = index.column("num_tokens").to_numpy().astype(np.int64)
    hashed = 0
    segs = _segments(index)
    rows_of = np.split(segs.order, segs.first[1:]) if checksums else []
    seg_rows = np.full(len(segs.first), -1, np.int64)  # each segment's rows (T); -1: unread
    verdicts: dict = {}  # Header (by identity: one per distinct header) -> (problem, T)
    files = ShardFiles(root / SHARDS_DIR, max_open=8)
    fd, fd_name, size = -1, None, 0
    for i in range(len(segs.first)):
        name = segs.names[segs.shard[i]]
        if name not in shards_on_disk:
            continue
        seg_off, seg_len = int(segs.offset[i]), int(segs.length[i])
        where = _where(name, seg_off)
        try:
            if name != fd_name:
                if fd >= 0:
                    os.close(fd)
                fd, fd_name = -1, None
                fd_path = root / SHARDS_DIR / name
                fd = os.open(fd_path, os.O_RDONLY)
                fd_name, size = name, os.fstat(fd).st_size
            hdr, data = read_header(fd, fd_path, seg_off, size)
        except Exception as e:  # an unreadable shard is a finding, not a crash
            problems.append(f"{where}: unreadable ({type(e).__name__}: {e})")
            continue
        problem, T = _segment_verdict(hdr, data, seg_off, seg_len, verdicts, expected_keys, manifest)
        if problem is not None:
            problems.append(f"{where}: {problem}")
            continue
        seg_rows[i] = T
        if not checksums:
            continue
        hashed += _check_checksums(files, index, name, seg_off, where, rows_of[i], T, offsets, ntok,
                                   problems)
    if fd >= 0:
        os.close(fd)
    files.close()
    problems += _rows_outside_segments(index, segs, seg_rows, offsets, ntok)
    return hashed


def _segment_verdict(hdr, data: int, seg_off: int, seg_len: int, verdicts: dict, expected_keys: set,
                     manifest: StoreManifest) -> tuple[str | None, int]:
    """(What is wrong with a segment whose header was read, or None; its rows T)."""
    end = data + hdr.data_bytes
    if seg_len >= 0 and end != seg_off + seg_len:
        return (f"the segment ends at byte {end}, the index says {seg_off + seg_len}", 0)
    v = verdicts.get(hdr)
    if v is None:
        problem = _header_problem(hdr, expected_keys, manifest)
        v = verdicts[hdr] = (problem, 0 if problem else hdr.tensors["input_ids"].shape[0])
    return v


def _check_checksums(files: ShardFiles, index: pa.Table, name: str, seg_off: int, where: str,
                     rows: np.ndarray, T: int, offsets: np.ndarray, ntok: np.ndarray,
                     problems: list[str]) -> int:
    """Hash the segment's in-bounds rows against their index checksums, appending mismatches
    to `problems`; returns the bytes hashed."""
    hashed = 0
    a, n = offsets[rows], ntok[rows]
    ok_rows = rows[(a >= 0) & (a + n <= T)]
    seg = files.segment(name, seg_off)
    keys = sorted(seg.keys())
    sums = index.column("checksum").take(pa.array(ok_rows)).to_pylist()
    sids = index.column("sample_id").take(pa.array(ok_rows)).to_pylist()
    try:
        for r, want, sid in zip(ok_rows, sums, sids):
            a0, n0 = int(offsets[r]), int(ntok[r])
            parts = [tensor_bytes(seg.rows(k, a0, a0 + n0)) for k in keys]
            hashed += sum(p.nbytes for p in parts)
            if sample_checksum(parts) != want:
                problems.append(f"{sid}: checksum mismatch in {where}")
    except Exception as e:
        problems.append(f"{where}: unreadable ({type(e).__name__}: {e})")
    return hashed


def _rows_outside_segments(index: pa.Table, segs: _Segments, seg_rows: np.ndarray, offsets: np.ndarray,
                           ntok: np.ndarray) -> list[str]:
    """The rows that lie outside their segment's T rows, for all read segments at once."""
    problems: list[str] = []
    T = seg_rows[segs.seg_of_row]
    bad = np.flatnonzero((T >= 0) & ((offsets < 0) | (offsets + ntok > T)))
    ids = index.column("sample_id")
    for r in bad:
        i = segs.seg_of_row[r]
        where = _where(segs.names[segs.shard[i]], int(segs.offset[i]))
        problems.append(f"{ids[int(r)].as_py()}: rows [{offsets[r]}, {offsets[r] + ntok[r]}) "
                        f"outside {where} ({T[r]} rows)")
    return problems


def _header_problem(hdr, expected_keys: set, manifest: StoreManifest) -> str | None:
    """What is wrong with a segment header against the manifest (None: nothing)."""
    keys = set(hdr.tensors)
    if keys != expected_keys:
        return f"tensors {sorted(keys)} != expected {sorted(expected_keys)}"
    T = hdr.tensors["input_ids"].shape[0]
    if hdr.tensors["aux"].shape != (T, manifest.aux_width) or \
            hdr.tensors["final"].shape != (T, manifest.hidden_size):
        return "tensor shapes do not match the manifest"
    return None


@dataclasses.dataclass
class _Segments:
    """The index's segments in (shard, offset) order, with numpy arrays only."""

    names: list[str]        # shard names; `shard` indexes into it
    shard: np.ndarray       # per segment
    offset: np.ndarray      # per segment: byte offset in the shard
    length: np.ndarray      # per segment: bytes (-1: the whole file)
    order: np.ndarray       # index rows sorted by segment
    first: np.ndarray       # per segment: its first position in `order`
    seg_of_row: np.ndarray  # per index row: its segment


def _segments(index: pa.Table) -> _Segments:
    """Group the index rows by (shard, shard_offset, segment_bytes), vectorised (a million
    rows: no Python object per row)."""
    d = pc.dictionary_encode(index.column("shard").combine_chunks())
    codes = d.indices.to_numpy().astype(np.int64)
    off = index.column("shard_offset").to_numpy().astype(np.int64)
    ln = index.column("segment_bytes").to_numpy().astype(np.int64)
    order = np.lexsort((ln, off, codes))
    c, o, l_ = codes[order], off[order], ln[order]
    new = np.ones(len(order), bool)
    new[1:] = (c[1:] != c[:-1]) | (o[1:] != o[:-1]) | (l_[1:] != l_[:-1])
    first = np.flatnonzero(new)
    seg_of_row = np.empty(len(order), np.int64)
    seg_of_row[order] = np.cumsum(new) - 1
    return _Segments(d.dictionary.to_pylist(), c[first], o[first], l_[first], order, first,
                     seg_of_row)


def row_bytes(manifest: StoreManifest) -> int:
    """Bytes one token takes in a segment, all tensors together (plan/budget.py's count)."""
    from eagle_ray.plan.budget import TOKEN_META_BYTES, feature_bytes_per_token

    return feature_bytes_per_token(len(manifest.aux_layer_ids), manifest.hidden_size,
                                   manifest.dtype) + TOKEN_META_BYTES


def _rows_within_segments(index: pa.Table, manifest: StoreManifest) -> list[str]:
    """From the index alone: every row's tokens lie inside its segment's bytes (a segment of
    L bytes holds at most (L - 8) / row_bytes tokens)."""
    if not index.num_rows:
        return []
    ln = index.column("segment_bytes").to_numpy()
    start = index.column("offset").to_numpy()
    end = start + index.column("num_tokens").to_numpy().astype(np.int64)
    bad = np.flatnonzero((start < 0) | ((ln >= 0) & (end * row_bytes(manifest) > ln - 8)))
    ids = index.column("sample_id")
    return [f"{ids[int(i)].as_py()}: rows [{start[i]}, {end[i]}) "
            f"do not fit its segment of {ln[i]} bytes in {index.column('shard')[int(i)].as_py()}"
            for i in bad[:20]]


@dataclasses.dataclass
class Layout:
    """How the committed segments cover each shard file (`layout`)."""

    problems: list[str]             # gaps (lost index parts), overlaps, truncated shards
    tails: dict[str, int]           # shard -> committed length, where the file is longer
    gaps: dict[str, list[list[int]]]  # shard -> [start, end) byte ranges no row references


def _writer_of(name: str, prefix: str, suffix: str) -> str:
    return name[len(prefix):-len(suffix)].rsplit("-", 1)[0]


def read_dropped(root: Path) -> dict[str, list[list[int]]]:
    path = Path(root) / DROPPED_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def layout(root: str | Path, index: pa.Table | None = None) -> Layout:
    """Check, from the index alone (Arrow; one stat per shard), that each shard is its
    committed segments back to back: a gap is bytes no committed write owns, i.e. a lost
    index part (damage), unless `store repair` dropped them (STORE/dropped.json). Bytes past
    the last committed segment are an interrupted write when the shard's writer left a
    temporary index part (store/writer.py), else a lost index part too."""
    root = Path(root)
    index = read_index(root) if index is None else index
    problems: list[str] = []
    tails: dict[str, int] = {}
    gaps: dict[str, list[list[int]]] = {}
    if not index.num_rows:
        return Layout(problems, tails, gaps)
    segs = (pa.table({"shard": index.column("shard"), "off": index.column("shard_offset"),
                      "len": index.column("segment_bytes")})
            .group_by(["shard", "off", "len"]).aggregate([])
            .sort_by([("shard", "ascending"), ("off", "ascending")]))
    enc = pc.dictionary_encode(segs.column("shard")).combine_chunks()
    names = enc.dictionary.to_pylist()
    code = enc.indices.to_numpy().astype(np.int64)
    sizes = np.full(len(names), -1, np.int64)
    for i, name in enumerate(names):
        try:
            sizes[i] = (root / SHARDS_DIR / name).stat().st_size
        except FileNotFoundError:
            pass  # verify names the missing shard
    off = segs.column("off").to_numpy()
    ln = segs.column("len").to_numpy()
    end = np.where(ln < 0, sizes[code], off + ln)  # -1: the whole file (one segment)
    first = np.ones(len(code), bool)
    first[1:] = code[1:] != code[:-1]
    start = np.where(first, 0, np.concatenate([[0], end[:-1]]))
    dropped = read_dropped(root)

    def covered(name: str, a: int, b: int) -> bool:
        return any(x <= a and b <= y for x, y in dropped.get(name, []))

    for i in np.flatnonzero(off != start):
        name = names[code[i]]
        if off[i] < start[i]:
            problems.append(f"{name}: segments overlap at byte {off[i]}")
        elif not covered(name, int(start[i]), int(off[i])):
            gaps.setdefault(name, []).append([int(start[i]), int(off[i])])
    last = np.flatnonzero(np.append(code[1:] != code[:-1], True))
    temp_writers = {_writer_of(p.name, ".part-", ".parquet.tmp")
                    for p in (root / INDEX_DIR).glob(".part-*.parquet.tmp")}
    for i in last:
        name, size, e = names[code[i]], int(sizes[code[i]]), int(end[i])
        if size < 0:
            continue
        if size < e:
            problems.append(f"{name}: {size} bytes, its committed segments end at byte {e} "
                            "(truncated)")
        elif size > e:
            if _writer_of(name, "shard-", ".safetensors") in temp_writers:
                tails[name] = e
            elif not covered(name, e, size):
                gaps.setdefault(name, []).append([e, size])
    for name, rs in gaps.items():
        for a, b in rs:
            problems.append(f"{name}: bytes [{a}, {b}) belong to no committed write (a lost "
                            "index part)")
    return Layout(problems, tails, gaps)


def interrupted_writes(root: str | Path, referenced: set[str] | None = None,
                       lay: Layout | None = None) -> tuple[list[Path], dict[Path, int]]:
    """The leftovers of writes that never reached their commit (store/writer.py): temporary
    files, shards that no index part references whose temporary index part is still there,
    and bytes past the last committed segment of a shard whose writer left a temporary part.
    They hold no committed sample: not damage, but garbage for the next exclusive writer to
    sweep. Returns (files to remove, shards first: removing in this order never leaves an
    orphan; {shard: committed length} of the shards to truncate, before the removals)."""
    root = Path(root)
    if referenced is None or lay is None:
        index = read_index(root)
        referenced = set(index.column("shard").to_pylist())
        lay = layout(root, index)
    part_temps = {p.name for p in (root / INDEX_DIR).glob(".part-*.tmp")}
    shards = [p for p in sorted((root / SHARDS_DIR).glob("shard-*.safetensors"))
              if p.name not in referenced
              and f".part-{p.name[len('shard-'):-len('.safetensors')]}.parquet.tmp" in part_temps]
    tails = {root / SHARDS_DIR / name: end for name, end in sorted(lay.tails.items())}
    return (shards + sorted((root / SHARDS_DIR).glob(".*.tmp"))
            + sorted((root / INDEX_DIR).glob(".*.tmp"))), tails


def check_store_whole(root: str | Path) -> dict[str, Any]:
    """The structural verify (index against the shard files; no header, no checksum: a
    damaged header or byte is found by the reader that meets it, naming the shard) that a
    consumer runs before trusting a store;
    raises StoreDamagedError naming the problems and the command that repairs them. The
    leftovers of interrupted writes are not damage (nothing of them is committed)."""
    rep = verify_store(root, checksums=False, headers=False)
    if not rep["ok"]:
        found = rep["problems"] + [f"orphan shard {o} (its index part is lost)" for o in rep["orphans"]]
        more = f" (+{len(found) - 3} more)" if len(found) > 3 else ""
        raise StoreDamagedError(f"store {root} is damaged: {'; '.join(found[:3])}{more}; "
                                f"{repair_hint(root)}")
    return rep


def decode(raw: dict, dtype=None) -> dict:
    """Storage tensors of one sample (what `encode` wrote, plus input_ids and loss_mask) ->
    {"input_ids" [T] int64, "loss_mask" [T] bool, "aux" [T, A*H], "final" [T, H]} in `dtype`
    (default float32). Also used by online training, whose features travel encoded."""
    import torch

    dtype = dtype or torch.float32
    aux, final = raw["aux"].to(dtype), raw["final"].to(dtype)
    if "aux_scale" in raw:  # fp8: per-token, per-layer scales
        T = aux.shape[0]
        A = raw["aux_scale"].shape[1]
        aux = (aux.reshape(T, A, -1) * raw["aux_scale"].to(dtype)[..., None]).reshape(T, -1)
        final = final * raw["final_scale"].to(dtype)
    return {"input_ids": raw["input_ids"].long(), "loss_mask": raw["loss_mask"].bool(),
            "aux": aux, "final": final}
