"""Output directories: no command deletes or mixes into what it did not write.

Every `--out` (generate, extract, train, export, evaluate) must be new, empty, or
recognisably the same command's earlier output: it holds OUT/.eagle-ray-output.json
(written when the command first claims the directory) or, for outputs written before
that marker existed, the file only that command writes (LEGACY). Anything else is refused
with a message naming the path; nothing is created or deleted on a refusal.

`replace_dir_atomically` is how export replaces an earlier export: the new directory is
written next to it under a temporary name and swapped in with one rename (renameat2
RENAME_EXCHANGE where the kernel has it), so readers see the old or the new directory,
never a mix, and a failure at any point leaves the old one and no temporary behind.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Iterable

from eagle_ray.common.atomic import atomic_write_json, fsync_dir

MARKER = ".eagle-ray-output.json"


class OutputDirError(ValueError):
    """An --out path that is not new, empty, or this command's own earlier output."""


def _json(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _is_store(p: Path) -> bool:
    d = _json(p / "manifest.json")
    return d is not None and "target_fingerprint" in d and "aux_layer_ids" in d


def _is_export(p: Path) -> bool:
    d = _json(p / "config.json")
    return d is not None and "eagle_ray" in d


# What each command's output held before the marker file existed.
LEGACY: dict[str, Callable[[Path], bool]] = {
    "generate": lambda p: (p / "generate_params.json").exists(),
    "extract": _is_store,
    "train": lambda p: (p / "run.json").exists(),
    "export": _is_export,
    "evaluate": lambda p: (p / "report.json").exists(),
}


def owner(path: Path) -> str | None:
    """The eagle-ray command that wrote this directory, if any."""
    d = _json(path / MARKER)
    if d is not None and isinstance(d.get("command"), str):
        return d["command"]
    for command, recognise in LEGACY.items():
        if recognise(path):
            return command
    return None


def check_output_dir(path: str | Path, command: str, *, only: Iterable[str] | None = None) -> Path:
    """Refuse `path` unless it is new, empty, or `command`'s earlier output (and, with
    `only`, holds nothing but those names). Creates nothing."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputDirError(f"--out {p} is a file, not a directory; choose a new or empty "
                             "directory")
    if not p.exists():
        return p
    # The run's logs (OUT/logs, eagle_ray/common/logs.py) are anyone's.
    entries = sorted(x.name for x in p.iterdir() if x.name != "logs")
    if not entries:
        return p
    who = owner(p)
    if who != command:
        what = (f"the output of `eagle-ray {who}`" if who else
                f"files eagle-ray did not write ({', '.join(entries[:3])}"
                f"{', ...' if len(entries) > 3 else ''})")
        raise OutputDirError(f"--out {p} exists and holds {what}; `eagle-ray {command}` writes "
                             "only into a new or empty directory or its own earlier output. "
                             "Choose another --out")
    if only is not None:
        extra = [e for e in entries if e not in set(only) | {MARKER}]
        if extra:
            raise OutputDirError(f"--out {p} is an earlier `eagle-ray {command}` output but also "
                                 f"holds {', '.join(extra[:3])}, which it did not write; replacing "
                                 "it would delete them. Move them away or choose another --out")
    return p


def claim_output_dir(path: str | Path, command: str) -> Path:
    """check_output_dir, then create the directory and mark it as `command`'s output."""
    p = check_output_dir(path, command)
    p.mkdir(parents=True, exist_ok=True)
    if not (p / MARKER).exists():
        atomic_write_json(p / MARKER, {"command": command})
    return p


def _exchange(a: Path, b: Path) -> None:
    """Atomically swap two directory entries (renameat2 RENAME_EXCHANGE), or fall back to
    two renames that undo themselves on failure."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is not None:
        at_fdcwd, rename_exchange = -100, 2
        if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(b))
    old = b.with_name(f".{b.name}.old-{os.getpid()}")
    os.rename(b, old)
    try:
        os.rename(a, b)
    except BaseException:
        os.rename(old, b)
        raise
    os.rename(old, a)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def replace_dir_atomically(out: str | Path, command: str, write: Callable[[Path], None],
                           *, only: Iterable[str]) -> Path:
    """Write a directory with `write(tmp)` and swap it in for `out` in one rename.

    `out` must pass check_output_dir(only=...). On any failure the temporary directory is
    removed and `out` is untouched; temporaries of killed earlier calls (same naming, dead
    pid) are removed first."""
    out = check_output_dir(out, command, only=only)
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.tmp-(\d+)$")
    for sib in parent.iterdir():
        m = pattern.match(sib.name)
        if m and sib.is_dir() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(sib, ignore_errors=True)
    tmp = parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write(tmp)
        atomic_write_json(tmp / MARKER, {"command": command})
        for f in tmp.rglob("*"):  # durable before it becomes visible under the real name
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(tmp)
        if out.exists():
            _exchange(tmp, out)  # tmp now holds the previous output
            fsync_dir(parent)
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, out)
            fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
