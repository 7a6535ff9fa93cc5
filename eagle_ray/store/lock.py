"""One writer per store: an advisory file lock on STORE/.lock.

    extract, store repair   exclusive (they add or remove commits)
    train                   shared    (many runs may read one store; no writer meanwhile)

Locks are never waited for: a second writer refuses at once, naming who holds the store
(pid, host, command, since when), so two extractions can never commit the same samples
twice. The kernel drops the lock when its process dies (kill -9 included), so a crashed
run never leaves a stale lock. The lock file is on the store's own file system (flock
works across NFS clients on Linux); the holder record inside it is only for the message.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

from eagle_ray.store.format import StoreError

LOCK_FILE = ".lock"


class StoreBusyError(StoreError):
    """Another process holds the store (a running extract, repair or training)."""


def _holder(fd: int) -> str:
    try:
        d = json.loads(os.pread(fd, 4096, 0).decode() or "null")
    except (OSError, ValueError):
        d = None
    if not isinstance(d, dict):
        return "a training run reading it (or another eagle-ray process)"
    return (f"`{d.get('command')}` (pid {d.get('pid')} on {d.get('host')}, since "
            f"{d.get('since')})")


@contextlib.contextmanager
def store_lock(root: str | Path, *, exclusive: bool, command: str) -> Iterator[None]:
    """Hold STORE/.lock for the block: exclusive for writers, shared for readers."""
    root = Path(root)
    if exclusive:
        root.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        if exclusive or e.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise
        try:  # a reader of a read-only store: lock what is there, or nothing to lock against
            fd = os.open(root / LOCK_FILE, os.O_RDONLY)
        except FileNotFoundError:
            yield
            return
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreBusyError(
                f"{root} is in use by {_holder(fd)}; `{command}` needs it "
                f"{'to itself' if exclusive else 'with no writer'}. Wait for that process to "
                "finish (or stop it) and run this again") from None
        if exclusive:
            # A new lease per exclusive holder: writers started under it stop committing once
            # another holder takes the store (see current_lease).
            record = {"command": command, "pid": os.getpid(), "host": socket.gethostname(),
                      "lease": uuid.uuid4().hex,
                      "since": time.strftime("%Y-%m-%dT%H:%M:%S"), "argv": sys.argv}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        try:
            yield
        finally:
            if exclusive:
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the lock


def current_lease(root: str | Path) -> str | None:
    """The lease of the store's current (or last) exclusive holder, None when unknown.

    Fencing for writers that outlive their run: an extractor actor of a killed job can still
    be finishing a batch while a resubmitted job already holds the store; it reads the lease
    when it starts and re-checks it right before each commit, and stops (committing nothing)
    when another holder has taken the store since."""
    try:
        return json.loads((Path(root) / LOCK_FILE).read_text() or "{}").get("lease")
    except (OSError, ValueError):
        return None
