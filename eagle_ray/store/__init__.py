"""The hidden-state store: safetensors shards with a Parquet index and a manifest (format.py is the contract)."""

from eagle_ray.store.reader import HiddenStateStore

__all__ = ["HiddenStateStore"]
