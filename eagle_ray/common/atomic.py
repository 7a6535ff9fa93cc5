"""Atomic writes: a file eagle_ray writes whole is there complete or not at all.

Every writer goes through here: the bytes go to a temporary name in the same directory
(`.NAME.tmp-PID`), are flushed and fsynced, and the temporary file is renamed over NAME (a
rename within one file system is atomic); the directory is then fsynced so the rename
itself survives a power cut. A crash leaves at most a temporary file, which readers never
look at and the next writer replaces. Appends to a growing file (store shards, logs) are
not whole-file writes and are not done here.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any, BinaryIO


def fsync_dir(path: str | Path) -> None:
    """fsync a directory (its entries: a rename into it is durable) or a file (its bytes).
    A failure is raised (a full or failing disk must not pass as written), except from a
    file system that cannot fsync a directory at all: its renames are atomic anyway."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def temporary_name(path: str | Path) -> Path:
    p = Path(path)
    return p.with_name(f".{p.name}.tmp-{os.getpid()}")


class AtomicFile:
    """A binary file written under its temporary name and renamed into place by `commit`
    (also on leaving a `with` block without an exception; an exception removes it)."""

    def __init__(self, path: str | Path, buffering: int = 1 << 20, tmp: Path | None = None) -> None:
        self.path = Path(path)
        self.tmp = tmp or temporary_name(self.path)  # a store names its temporaries itself
        self.f: BinaryIO = open(self.tmp, "wb", buffering=buffering)

    def write(self, data: bytes) -> int:
        return self.f.write(data)

    def finish(self) -> None:
        """Flush and fsync the temporary file (the rename happens in `commit`): several
        files can be finished first and renamed together."""
        if not self.f.closed:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()

    def commit(self, *, sync_dir: bool = True) -> None:
        self.finish()
        os.replace(self.tmp, self.path)
        if sync_dir:
            fsync_dir(self.path.parent)

    def abort(self) -> None:
        try:
            self.f.close()
        finally:
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with AtomicFile(path) as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def atomic_write_parquet(path: str | Path, table, compression: str = "zstd",
                         tmp: Path | None = None) -> None:
    import pyarrow.parquet as pq

    with AtomicFile(path, tmp=tmp) as f:
        pq.write_table(table, f.f, compression=compression)
