"""Training checkpoints that survive a crash at any byte.

    RUN_DIR/checkpoints/step-NNNNNNN/
        model.safetensors, optim.pt, rng/rank*.pt
        state.json     step, epoch, step_in_epoch, world, and "files": size + blake2b of
                       every other file (written last)

Written as step-N.tmp/: every file fsynced, then the directory, then renamed to step-N and
the parent fsynced. A checkpoint "loads" when state.json parses and every file it lists
has its recorded size and hash (checkpoints from before the hash list: when the weights
and optimizer state deserialize). Resume and export take the newest checkpoint that
loads, warning about each newer one skipped; `keep` prunes all but the newest N.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from eagle_ray.common.errors import UserFault
from eagle_ray.common.atomic import atomic_write_json, fsync_dir

logger = logging.getLogger(__name__)

STATE_FILE = "state.json"
_STEP = re.compile(r"^step-\d+$")


class CheckpointError(UserFault, RuntimeError):
    """A checkpoint that is truncated, corrupted or missing files."""


def _hash(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories (renamed into place), newest first."""
    d = Path(run_dir) / "checkpoints"
    if not d.exists():
        return []
    return sorted((p for p in d.glob("step-*") if p.is_dir() and _STEP.match(p.name)),
                  reverse=True)  # not step-N.tmp (being written) nor step-N.old (being replaced)


def commit_checkpoint(tmp: Path, final: Path, state: dict[str, Any]) -> Path:
    """fsync tmp's files, record their sizes/hashes in state.json, rename tmp -> final."""
    files = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            fsync_dir(p)  # the file's bytes
            files[str(p.relative_to(tmp))] = {"size": p.stat().st_size, "blake2b": _hash(p)}
    for d in sorted({p.parent for p in tmp.rglob("*")} | {tmp}):
        fsync_dir(d)
    atomic_write_json(tmp / STATE_FILE, {**state, "files": files})
    if final.exists():  # an earlier attempt at this step (e.g. a corrupt one being redone)
        trash = final.with_name(final.name + ".old")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def validate(ckpt: Path) -> dict[str, Any]:
    """The checkpoint's state if every file is intact, else CheckpointError naming it."""
    path = ckpt / STATE_FILE
    try:
        state = json.loads(path.read_text())
        int(state["step"]), int(state["epoch"]), int(state["step_in_epoch"])
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is damaged ({type(e).__name__}: {e})") from None
    files = state.get("files")
    if files is None:  # written before hashes were recorded: try to deserialize
        _try_load(ckpt)
        return state
    for name, meta in files.items():
        f = ckpt / name
        if not f.exists():
            raise CheckpointError(f"{f} is missing")
        if f.stat().st_size != meta["size"]:
            raise CheckpointError(f"{f} has {f.stat().st_size} bytes, {meta['size']} were written "
                                  "(truncated)")
        if _hash(f) != meta["blake2b"]:
            raise CheckpointError(f"{f} does not match its recorded hash (corrupted)")
    return state


def _try_load(ckpt: Path) -> None:
    import torch
    from safetensors.torch import load_file

    for name, load in (("model.safetensors", lambda p: load_file(str(p))),
                       ("optim.pt", lambda p: torch.load(p, weights_only=True))):
        try:
            load(ckpt / name)
        except Exception as e:  # SafetensorError, pickle/zip errors, OSError
            raise CheckpointError(f"{ckpt / name} does not load ({type(e).__name__}: {e})") from None


def newest_loadable(run_dir: str | Path) -> Path | None:
    """The newest checkpoint that loads (warning about each newer one skipped); None when the
    run has none; CheckpointError when it has some and none loads."""
    found = checkpoints(run_dir)
    skipped = []
    for ckpt in found:
        try:
            validate(ckpt)
        except CheckpointError as e:
            logger.warning("skipping checkpoint %s: %s", ckpt, e)
            skipped.append(str(e))
            continue
        if skipped:
            logger.warning("using checkpoint %s, the newest one that loads", ckpt.name)
        return ckpt
    if found:
        raise CheckpointError(f"no checkpoint in {Path(run_dir) / 'checkpoints'} loads "
                              f"(newest: {skipped[0]}); train again with a new --out run directory")
    return None


def prune(run_dir: str | Path, keep: int, protect: Path | None = None) -> None:
    """Delete all but the newest `keep` checkpoints (0 keeps all); never `protect`."""
    if keep <= 0:
        return
    for old in checkpoints(run_dir)[keep:]:
        if protect is None or old.resolve() != protect.resolve():
            shutil.rmtree(old, ignore_errors=True)
