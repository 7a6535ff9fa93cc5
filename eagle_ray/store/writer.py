"""Writing the hidden-state store: one segment + one index part per call, both atomic.

A writer appends each write's shard segment to its current shard file until that file
reaches `storage.shard_bytes` (store/segments.py), then starts a new one. Commit order
(crash-safe):

    new shard:  shards/.shard-W-S.safetensors.tmp -> fsync      (S = this write's seq)
                index/.part-W-S.parquet.tmp       -> fsync
                rename -> shards/shard-W-S.safetensors
                rename -> index/part-W-S.parquet                          (the commit)
    append:     index/.part-W-S'.parquet.tmp -> fsync
                append the segment to shards/shard-W-S.safetensors -> fsync
                rename -> index/part-W-S'.parquet                         (the commit)

A crash (kill -9 of an actor, the node) before the commit leaves an *interrupted write*:
temporary files, a new shard next to its still-temporary index part, or bytes past the
last committed segment of a shard. Never an index row pointing at a partial segment. An
interrupted write holds no committed sample, so it is not damage: readers never see it,
training accepts the store, and the next exclusive writer (`extract`, `generate-extract`,
`store repair`) removes it when it takes the store (`sweep_interrupted`: temporary files
and new shards are unlinked, tails truncated). An orphan shard *without* its temporary
part can only mean a lost index part, and that is damage (`store verify` fails, training
refuses, `store repair`). W is a per-writer id, so many extractor actors write one store
concurrently without locks: a writer only ever appends to its own files.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle_ray.common.atomic import atomic_write_json, fsync_dir
from eagle_ray.store.format import (FP8_MAX, INDEX_DIR, INDEX_SCHEMA, MANIFEST_FILE, SHARDS_DIR,
                                    TORCH_DTYPES, StoreError, StoreManifest, sample_checksum,
                                    tensor_bytes)
from eagle_ray.store.lock import current_lease
from eagle_ray.store.reader import read_manifest

logger = logging.getLogger(__name__)


class StoreWriteError(StoreError):
    """A shard or index part could not be written (full disk, I/O error)."""


class StoreMismatchError(ValueError):
    """The store at this path was written for another target / layers / tokenizer / dtype."""


@dataclass
class SampleFeatures:
    """One sample's captured features (float32) and tokens, already end-truncated."""

    sample_id: str
    source: str | None
    input_ids: np.ndarray      # [T] int
    loss_mask: np.ndarray      # [T] bool
    aux: "torch.Tensor"        # [T, A*H] float32  # noqa: F821
    final: "torch.Tensor"      # [T, H] float32    # noqa: F821
    num_tokens_untruncated: int


def open_or_create(root: str | Path, manifest: StoreManifest) -> Path:
    """Create the store layout, or check that an existing store means the same features."""
    root = Path(root)
    path = root / MANIFEST_FILE
    if path.exists():
        existing = read_manifest(root)  # a damaged manifest: StoreError naming the file
        diff = existing.mismatches(manifest)
        if diff:
            detail = "; ".join(f"{k}: store has {a!r}, this run has {b!r}" for k, (a, b) in diff.items())
            raise StoreMismatchError(
                f"{root} was written for other features ({detail}). Refusing to mix them: "
                "extract into a new store directory")
    else:
        (root / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        (root / INDEX_DIR).mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, manifest.to_dict())
    return root


def encode(aux, final, dtype: str, num_layers_aux: int) -> dict:
    """Float32 features -> storage tensors (fp8: per-token, per-layer absmax scales)."""
    import torch

    if dtype != "fp8_e4m3":
        tdt = getattr(torch, TORCH_DTYPES[dtype])
        return {"aux": aux.to(tdt).contiguous(), "final": final.to(tdt).contiguous()}
    T = aux.shape[0]
    a = aux.reshape(T, num_layers_aux, -1)
    a_scale = (a.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-12)            # [T, A]
    f_scale = (final.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # [T, 1]
    return {"aux": (a / a_scale[..., None]).to(torch.float8_e4m3fn).reshape(T, -1).contiguous(),
            "aux_scale": a_scale.float().contiguous(),
            "final": (final / f_scale).to(torch.float8_e4m3fn).contiguous(),
            "final_scale": f_scale.float().contiguous()}


class StaleWriterError(StoreError):
    """A writer of a run that no longer holds the store."""


class StoreWriter:
    def __init__(self, root: str | Path, manifest: StoreManifest, *, writer_id: str | None = None,
                 compact_every: int | None = None, shard_bytes: int = 1):
        from eagle_ray.store.compact import COMPACT_EVERY_PARTS

        self.root = open_or_create(root, manifest)
        self.manifest = manifest
        self.writer_id = writer_id or uuid.uuid4().hex[:12]
        self.seq = 0
        self.committed = 0
        # Every this many commits the writer compacts the index (0: never).
        self.compact_every = COMPACT_EVERY_PARTS if compact_every is None else compact_every
        self.lease = current_lease(self.root)  # the run this writer belongs to
        # Appends go to the current shard until it holds shard_bytes (1: a shard per write).
        self.shard_bytes = shard_bytes
        self._shard: Path | None = None
        self._shard_end = 0  # bytes of the current shard that are committed

    def _check_lease(self) -> None:
        if self.lease is not None and current_lease(self.root) != self.lease:
            raise StaleWriterError(
                f"{self.root} has been taken by another run since this writer started (its run "
                "was stopped or killed); this batch is not committed, the new run extracts it")

    def write_shard(self, samples: list[SampleFeatures]) -> pa.Table:
        """Write samples as one shard and commit their index rows. Returns the rows."""
        from safetensors.torch import save

        if not samples:
            return INDEX_SCHEMA.empty_table()
        self._check_lease()
        m = self.manifest
        tensors = self._tensors(samples)
        rows = _index_rows(samples, tensors)

        data = save(tensors, metadata={"schema_version": str(m.schema_version), "dtype": m.dtype})
        name = f"{self.writer_id}-{self.seq:05d}"
        self.seq += 1
        new = self._shard is None or (self._shard_end > 0
                                      and self._shard_end + len(data) > self.shard_bytes)
        shard = self.root / SHARDS_DIR / f"shard-{name}.safetensors" if new else self._shard
        start = 0 if new else self._shard_end
        part = self.root / INDEX_DIR / f"part-{name}.parquet"
        for r in rows:
            r["shard"] = shard.name
            r["shard_offset"] = start
            r["segment_bytes"] = len(data)
        table = pa.Table.from_pylist(rows, schema=INDEX_SCHEMA)
        self._commit(data, table, shard, part, start, new)
        self._shard, self._shard_end = shard, start + len(data)
        self._maybe_compact()
        return table

    def _tensors(self, samples: list[SampleFeatures]) -> dict:
        """The batch's storage tensors, all samples' rows concatenated (shapes checked)."""
        import torch

        m = self.manifest
        A, H = len(m.aux_layer_ids), m.hidden_size
        for s in samples:
            T = len(s.input_ids)
            assert s.aux.shape == (T, A * H) and s.final.shape == (T, H), (s.aux.shape, s.final.shape, T)
        ids = torch.from_numpy(np.concatenate([np.asarray(s.input_ids, np.int32) for s in samples]))
        mask = torch.from_numpy(np.concatenate([np.asarray(s.loss_mask, np.uint8) for s in samples]))
        tensors = encode(torch.cat([s.aux for s in samples]), torch.cat([s.final for s in samples]),
                         m.dtype, A)
        tensors.update(input_ids=ids, loss_mask=mask)
        return tensors

    def _commit(self, data: bytes, table: pa.Table, shard: Path, part: Path, start: int,
                new: bool) -> None:
        """Write the segment and the index part in the crash-safe order (module doc) and commit
        them; on failure remove what was written and raise (StoreWriteError for an OSError)."""
        shard_tmp = shard.with_name(f".{shard.name}.tmp")
        part_tmp = part.with_name(f".{part.name}.tmp")
        appended = False
        try:
            if new:
                with open(shard_tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            with open(part_tmp, "wb") as f:
                pq.write_table(table, f)
                f.flush()
                os.fsync(f.fileno())
            if not new:
                with open(shard, "r+b") as f:
                    f.truncate(start)  # a tail an earlier failed append may have left
                    f.seek(start)
                    appended = True
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            self._check_lease()  # a writer of a stopped run must not commit over a new one
            if new:
                os.replace(shard_tmp, shard)  # both files are whole before either is renamed
                fsync_dir(shard.parent)
            os.replace(part_tmp, part)  # the commit point
            fsync_dir(part.parent)
            self.committed += 1
        except BaseException as e:
            _remove_uncommitted(shard, shard_tmp, part, part_tmp, start, new, appended)
            if isinstance(e, OSError):
                raise StoreWriteError(
                    f"writing {shard} failed ({e.strerror or e}); nothing of this batch was "
                    f"committed. Free space on {self.root} (or fix the file system) and re-run "
                    "`eagle-ray extract`: it resumes where it stopped") from e
            raise

    def _maybe_compact(self) -> None:
        """Compact the index every `compact_every` commits; a failure is only logged."""
        if self.compact_every and self.committed % self.compact_every == 0:
            from eagle_ray.store.compact import compact

            try:  # the batch is committed: a failed compaction only leaves parts uncompacted
                compact(self.root, blocking=False)
            except OSError as e:
                logger.warning("%s: index compaction skipped (%s); the parts stay readable",
                               self.root, e.strerror or e)


def _index_rows(samples: list[SampleFeatures], tensors: dict) -> list[dict]:
    """Each sample's index row (its rows in the segment, token counts, checksum), without
    its shard placement."""
    rows, offset = [], 0
    for s in samples:
        T = len(s.input_ids)
        checksum = sample_checksum([tensor_bytes(tensors[k][offset:offset + T])
                                    for k in sorted(tensors)])
        rows.append({"sample_id": s.sample_id, "source": s.source, "offset": offset,
                     "num_tokens": T, "num_loss_tokens": int(np.asarray(s.loss_mask).sum()),
                     "truncated": s.num_tokens_untruncated > T,
                     "num_tokens_untruncated": s.num_tokens_untruncated, "checksum": checksum})
        offset += T
    return rows


def _remove_uncommitted(shard: Path, shard_tmp: Path, part: Path, part_tmp: Path, start: int, new: bool,
                        appended: bool) -> None:
    """Remove what a failed write left: its temporary files, a new shard or an appended tail."""
    # ENOSPC and friends: leave nothing half-written. A new shard whose index part
    # did not land is garbage, so is an appended tail; remove them now rather than
    # leave them for repair.
    if appended and not part.exists():
        try:  # before the temporary part goes: a tail without one reads as damage
            os.truncate(shard, start)
        except OSError:
            pass  # the tail stays an interrupted write for the next sweep
    for p in (shard_tmp, part_tmp):
        p.unlink(missing_ok=True)
    if not part.exists() and new:
        shard.unlink(missing_ok=True)


def sweep_interrupted(root: str | Path) -> list[str]:
    """Remove the leftovers of interrupted writes (see the module doc); returns their names.

    Only for a process that holds the store exclusively (store_lock), before its own writers
    start: a writer of a stopped run that is still finishing a batch loses its temporary
    files here and, fenced by the lease, commits nothing."""
    from eagle_ray.store.reader import interrupted_writes

    root = Path(root)
    paths, tails = interrupted_writes(root)
    for p, end in tails.items():  # first: a tail whose temporary part is gone reads as damage
        with open(p, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    for p in paths:  # shards before temporary parts: a crash in between leaves a plain
        p.unlink(missing_ok=True)  # temporary file, still an interrupted write
    names = [p.name for p in paths] + [p.name for p in tails]
    if names:
        fsync_dir(root / SHARDS_DIR)
        fsync_dir(root / INDEX_DIR)
        logger.info("%s: removed %d leftover(s) of interrupted writes: %s", root, len(names),
                    ", ".join(names[:4]) + (" ..." if len(names) > 4 else ""))
    return names
