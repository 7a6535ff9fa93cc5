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

Everything about checkpoints is here: writing one from the training workers (`save`: every
rank its RNG state, rank 0 the rest), reading one back into them (`load`), checking and
choosing (`validate`, `newest_loadable`), pruning.
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


# --------------------------------------------------------------------------- writing, reading


def disk_full(path: Path, e: BaseException, margin: int = 16 << 20) -> bool:
    """Whether a failed write failed because the disk is full. torch.save's zip writer says
    only "[enforce fail at inline_container.cc] unexpected pos N vs M" (no errno), so when
    no ENOSPC/EDQUOT is in the exception chain, ask the filesystem."""
    import errno

    x, seen = e, set()
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        x = x.__cause__ or x.__context__
    try:
        return shutil.disk_usage(path).free < margin
    except OSError:
        return False


def _disk_full_error(run_dir: Path, name: str) -> CheckpointError:
    prev = newest_loadable(run_dir)
    return CheckpointError(
        f"disk full at {run_dir / 'checkpoints'} while writing checkpoint {name}; "
        + (f"{prev.name} is intact" if prev else "no earlier checkpoint was written")
        + "; free space and re-run to resume")


def _save_rng(run_dir: Path, step: int, rank: int) -> None:
    """Each rank writes its RNG states next to the checkpoint (before rank 0 renames it)."""
    import torch

    d = run_dir / "checkpoints" / f"rng-{step:07d}"
    d.mkdir(parents=True, exist_ok=True)
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    try:
        torch.save(states, d / f"rank{rank}.pt")
    except Exception as e:
        if not disk_full(d, e):
            raise
        raise _disk_full_error(run_dir, f"step-{step:07d}") from e


def _write(run_dir: Path, step: int, model, opt, sched, state: dict, rng_dir: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    final = run_dir / "checkpoints" / f"step-{step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
        torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp / "optim.pt")
        os.replace(rng_dir, tmp / "rng")
        return commit_checkpoint(tmp, final, state)  # fsync files + dir, hashes, rename
    except Exception as e:
        if not disk_full(final.parent, e):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # the half-written checkpoint, never loaded
        raise _disk_full_error(run_dir, final.name) from e


def save(run_dir: Path, position: dict[str, int], model, opt, sched, *, rank: int, world: int,
         barrier, keep: int = 0) -> None:
    """A checkpoint of every rank at `position` ({"step", "epoch", "step_in_epoch"}): each
    rank saves its RNG state, then rank 0 writes the model, optimizer and scheduler and
    renames the whole atomically, then keeps only the newest `keep` checkpoints (0: all).
    `barrier` synchronises the ranks (torch.distributed.barrier)."""
    step = position["step"]
    _save_rng(run_dir, step, rank)
    barrier()
    if rank == 0:
        _write(run_dir, step, model, opt, sched, {**position, "world": world},
               run_dir / "checkpoints" / f"rng-{step:07d}")
        prune(run_dir, keep)
    barrier()


def load(ckpt: Path, model, opt, sched, *, rank: int, device, use_gpu: bool) -> dict[str, int]:
    """Model, optimizer, scheduler and this rank's RNG state from `ckpt` (the driver chose it
    with `newest_loadable`, the same for every rank); returns its position."""
    import torch
    from safetensors.torch import load_file

    model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)
    o = torch.load(ckpt / "optim.pt", weights_only=True, map_location=device)
    opt.load_state_dict(o["optimizer"])
    sched.load_state_dict(o["scheduler"])
    state = json.loads((ckpt / STATE_FILE).read_text())
    rng = ckpt / "rng" / f"rank{rank}.pt"
    if rng.exists():
        r = torch.load(rng, weights_only=True)
        torch.set_rng_state(r["torch"])
        if use_gpu and "cuda" in r:
            torch.cuda.set_rng_state(r["cuda"])
    return {k: state[k] for k in ("step", "epoch", "step_in_epoch")}
