"""Draft vocabulary: the N most frequent target tokens, and the d2t / t2d maps vLLM loads.

Conventions (identical to SpecForge's exports and to what vLLM's ``Eagle3LlamaForCausalLM``
reads, see ``vllm/model_executor/models/llama_eagle3.py``):

* ``d2t`` [N] int64 holds OFFSETS, not ids: draft index ``i`` is target token ``i + d2t[i]``.
  vLLM loads it as ``draft_id_to_target_id`` and in ``compute_logits`` scatters the draft
  logits to ``arange(N) + draft_id_to_target_id`` (every other target id gets -inf).
* ``t2d`` [V] bool: ``t2d[v]`` is True iff target token ``v`` is in the draft vocabulary.
  vLLM skips it when loading; it is exported anyway (SpecForge does) and used in training.

Selection: the ``N`` tokens with the highest counts, ties broken by the LOWER token id (so the
result is deterministic). Ordering: draft indices are assigned in ascending TARGET id order,
so ``d2t`` is non-decreasing and non-negative, and ``target_ids[t2d]`` enumerates the draft
vocabulary in draft-index order (the two maps agree).
"""

from __future__ import annotations

import torch

__all__ = [
    "build_draft_vocab",
    "draft_target_ids",
    "draft_to_target",
    "target_to_draft_map",
]


def build_draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``draft_vocab_size`` tokens by count -> ``(d2t [N] long, t2d [V] bool)``.

    ``token_counts`` [V]: how often each target token occurs at loss-masked positions.
    If ``V < draft_vocab_size`` the draft vocabulary is the whole target vocabulary (N = V).
    """
    counts = torch.as_tensor(token_counts)
    if counts.dim() != 1 or counts.numel() == 0:
        raise ValueError(f"token_counts must be a non-empty 1-D tensor, got shape {tuple(counts.shape)}")
    if counts.is_floating_point() or counts.is_complex():
        raise ValueError(f"token_counts must be integer counts, got {counts.dtype}")
    if draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    counts = counts.detach().to("cpu", torch.int64)
    if bool((counts < 0).any()):
        raise ValueError("token_counts must be non-negative")
    V = counts.numel()
    N = min(int(draft_vocab_size), V)
    # Stable descending sort: equal counts keep ascending id order -> ties go to the lower id.
    order = torch.sort(counts, descending=True, stable=True).indices
    target_ids = torch.sort(order[:N]).values  # draft index order = ascending target id
    d2t = target_ids - torch.arange(N, dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d


def draft_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[N] target token id of every draft index (``arange(N) + d2t``)."""
    return torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device) + d2t.to(torch.int64)


def draft_to_target(idx: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """Map draft indices (any shape) to target token ids: ``idx + d2t[idx]``."""
    idx = torch.as_tensor(idx, device=d2t.device).to(torch.int64)
    return idx + d2t.to(torch.int64)[idx]


def target_to_draft_map(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] int64: draft index of every target token, -1 where it is not in the draft vocab."""
    target_ids = draft_target_ids(d2t)
    if target_ids.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab_size):
        raise ValueError("d2t maps a draft index outside the target vocabulary")
    out = torch.full((vocab_size,), -1, dtype=torch.int64, device=d2t.device)
    out[target_ids] = torch.arange(target_ids.numel(), dtype=torch.int64, device=d2t.device)
    return out
