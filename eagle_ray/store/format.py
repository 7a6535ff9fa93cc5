"""The hidden-state store contract: manifest, shard tensors, index rows, storage dtypes.

    STORE/manifest.json                      identity of what the features mean (frozen)
    STORE/shards/shard-<writer>-<seq>.safetensors   segments, one per write (store/segments.py),
                                                    each a whole safetensors file's bytes:
        aux        [T, A*H]  storage dtype    A = len(aux_layer_ids), layer blocks in id order
        final      [T, H]    storage dtype    last layer output after the final norm
        input_ids  [T]       int32
        loss_mask  [T]       uint8
        aux_scale  [T, A]    float32          fp8_e4m3 only: one scale per token per layer
        final_scale[T, 1]    float32          fp8_e4m3 only
    STORE/index/part-<writer>-<seq>.parquet  one row per sample (INDEX_SCHEMA)

Many samples are concatenated along T in one segment; a sample is rows
[offset, offset + num_tokens) of every tensor of the segment at byte `shard_offset` of its
shard. A new shard is written under a temporary name and renamed when complete, a later
segment is appended to it; either way the index part is renamed into place only after the
shard bytes are on disk, so an index row never points at a partial segment. A sample
exists iff its row does.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Any

import pyarrow as pa

from eagle_ray.common.errors import UserFault

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"
DROPPED_FILE = "dropped.json"  # byte ranges of shards `store repair` dropped (not lost parts)
SHARDS_DIR = "shards"
INDEX_DIR = "index"

CAPTURE_CONVENTION = "aux[i] = residual stream entering decoder layer i (HF hidden_states[i])"
FINAL_CONVENTION = "final = last decoder layer output after the final norm (lm_head(final) = logits)"

INDEX_SCHEMA = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("source", pa.string()),
    pa.field("shard", pa.string(), nullable=False),          # file name under shards/
    pa.field("shard_offset", pa.int64(), nullable=False),    # byte offset of the segment
    pa.field("segment_bytes", pa.int64(), nullable=False),   # its length; -1: the whole file
    pa.field("offset", pa.int64(), nullable=False),          # first token row in the shard
    pa.field("num_tokens", pa.int32(), nullable=False),      # after end-truncation
    pa.field("num_loss_tokens", pa.int32(), nullable=False),
    pa.field("truncated", pa.bool_(), nullable=False),
    pa.field("num_tokens_untruncated", pa.int32(), nullable=False),
    pa.field("checksum", pa.string(), nullable=False),       # blake2b-128 of the sample's bytes
])

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8_e4m3": "float8_e4m3fn"}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True, kw_only=True)
class StoreManifest:
    """What a store's features mean. Two extractions may share a store only if equal."""

    schema_version: int = SCHEMA_VERSION
    target_path: str
    target_revision: str | None
    target_fingerprint: str
    architecture: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    aux_layer_ids: tuple[int, ...]
    capture_convention: str = CAPTURE_CONVENTION
    final_convention: str = FINAL_CONVENTION
    dtype: str
    max_seq_len: int
    tokenizer_fingerprint: str
    generation: dict | None = None
    """Provenance of the conversations (the generate manifest's mode/sampling/target)."""

    # Fields that must match for a store to be appended to (generation may differ: a
    # store can mix regenerated and logged conversations only if the user re-uses it).
    IDENTITY = ("schema_version", "target_fingerprint", "hidden_size", "num_layers",
                "vocab_size", "aux_layer_ids", "capture_convention", "final_convention",
                "dtype", "max_seq_len", "tokenizer_fingerprint")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StoreManifest":
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["aux_layer_ids"] = tuple(kw["aux_layer_ids"])
        return cls(**kw)

    def mismatches(self, other: "StoreManifest") -> dict[str, tuple[Any, Any]]:
        return {k: (getattr(self, k), getattr(other, k)) for k in self.IDENTITY
                if getattr(self, k) != getattr(other, k)}

    @property
    def aux_width(self) -> int:
        return len(self.aux_layer_ids) * self.hidden_size


def stored_tensors(dtype: str) -> set[str]:
    """The tensor names of a segment (module doc) in this storage dtype."""
    return {"aux", "final", "input_ids", "loss_mask"} | (
        {"aux_scale", "final_scale"} if dtype == "fp8_e4m3" else set())


def sample_checksum(parts: list[bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p)
    return h.hexdigest()


class StoreError(UserFault, RuntimeError):
    """A store is unreadable or a sample fails its checksum."""


class StoreDamagedError(StoreError):
    """A structural problem (lost index part, missing or truncated shard, duplicate commit)."""


def tensor_bytes(t) -> memoryview:
    """The tensor's bytes as a buffer for hashing (no copy when it is contiguous)."""
    import torch

    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


def repair_hint(root: str | Path) -> str:
    return (f"run `eagle-ray store repair {root}` (drops what is damaged, keeps one verified "
            "copy of each sample), then `eagle-ray extract` again to redo the dropped samples")
