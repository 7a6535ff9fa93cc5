"""Model batches from store samples (used by training and by offline evaluation).

`collate` right-pads samples of different lengths into one batch; `attention_mask` marks the
real tokens. Right padding with a causal model: padding after a sequence cannot change its
real positions, and the drafter masks padded columns out of its loss and attention.
"""

from __future__ import annotations

from typing import Sequence

import torch

from eagle_ray.store.reader import HiddenStateStore


def collate(store: HiddenStateStore, ids: Sequence[str], *,
            verify: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids/loss_mask/attention_mask [B, T], aux [B, T, 3H], final [B, T, H].
    `verify`: check each sample's checksum as it is read (StoreError names sample and shard)."""
    return collate_samples([store.get(sid, verify=verify) for sid in ids])


def collate_samples(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The batch of decoded samples (from a store, or from online extraction)."""
    B, T = len(samples), max(len(s["input_ids"]) for s in samples)
    A, H = samples[0]["aux"].shape[1], samples[0]["final"].shape[1]
    out = {"input_ids": torch.zeros(B, T, dtype=torch.long),
           "loss_mask": torch.zeros(B, T, dtype=torch.bool),
           "attention_mask": torch.zeros(B, T, dtype=torch.bool),
           "aux": torch.zeros(B, T, A), "final": torch.zeros(B, T, H)}
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        out["input_ids"][b, :n] = s["input_ids"]
        out["loss_mask"][b, :n] = s["loss_mask"]
        out["attention_mask"][b, :n] = True
        out["aux"][b, :n] = s["aux"]
        out["final"][b, :n] = s["final"]
    return out
