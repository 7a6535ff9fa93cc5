"""Training data from the hidden-state store: split, draft vocab counts, batches, loader.

Each Ray Train worker reads its own batches straight from the store (memory-mapped shard
slices on shared storage) instead of streaming features through Ray Data's object store:
the features are the bulk of the bytes (8H per token), a per-rank reader never copies them
through another process, and the data position is two integers (epoch, step), so a resumed
run continues with exactly the batches it would have seen. bench/bench_train.py measures
the fraction of step time spent waiting for data.

Batching: length bucketing under a token budget. Samples are sorted by length inside
shuffled windows, cut into micro-batches whose padded size B x T_max stays under
`tokens_per_batch`, and the batch order is shuffled per epoch (seeded). Packing would waste
no padding but needs per-sample attention masks through every TTT step; bucketing keeps
padding small (similar lengths together) with plain right padding.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch

from eagle_ray.store.reader import HiddenStateStore


def split_ids(ids: Sequence[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Stable train/validation split by PROMPT-id hash: every completion of a prompt
    (`<prompt>#<j>`) lands on the same side, so none of a held-out prompt's is trained on;
    adding samples keeps old ones put."""
    from eagle_ray.data.ids import prompt_id

    train, val = [], []
    for sid in ids:
        h = int.from_bytes(hashlib.blake2b(prompt_id(sid).encode(), digest_size=8).digest(), "little")
        (val if h / 2**64 < val_fraction else train).append(sid)
    return train, val


def loss_token_counts(samples: Iterable[tuple], vocab_size: int) -> torch.Tensor:
    """[V] counts of tokens at loss-masked positions of (input_ids, loss_mask) pairs (a
    store's, only ids and masks read; or an online run's windows)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tok, mask in samples:
        tok = torch.as_tensor(tok).long()[torch.as_tensor(mask).bool()]
        counts += torch.bincount(tok, minlength=vocab_size)
    return counts


def make_batches(lengths: Sequence[int], tokens_per_batch: int, seed: int) -> list[list[int]]:
    """Micro-batches of sample indices, padded size <= tokens_per_batch (a longer sample
    gets a batch of its own). Deterministic for (lengths, budget, seed); numpy throughout
    (a million samples in well under a second): a seeded permutation, windows sorted by
    length (stable), each batch the longest run from its first sample that fits."""
    rng = np.random.default_rng(seed)
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    n = len(lens)
    order = rng.permutation(n)
    window = 64 * max(1, tokens_per_batch // max(1, int(np.mean(lens)) if n else 1))
    batches: list[list[int]] = []
    for lo in range(0, n, window):
        idx = order[lo:lo + window]
        idx = idx[np.argsort(lens[idx], kind="stable")]
        L = lens[idx]
        s, m = 0, len(idx)
        while s < m:
            # L is sorted, so L[e] is the longest of a batch [s, e] and (e - s + 1) * L[e]
            # grows with e: the batch ends before the first e where that passes the budget.
            cap = min(m - s, tokens_per_batch // max(1, int(L[s])) + 1)
            over = np.arange(1, cap + 1) * L[s:s + cap] > tokens_per_batch
            over[0] = False  # the first sample always goes in (alone, if it is too long)
            e = s + (int(np.argmax(over)) if over.any() else cap)
            batches.append(idx[s:e].tolist())
            s = e
    return [batches[i] for i in rng.permutation(len(batches))]


def sample_lengths(store: HiddenStateStore, ids: Sequence[str]) -> list[int]:
    """Each id's token count (`HiddenStateStore.lengths`)."""
    return store.lengths(ids)


def epoch_batches(lengths: Sequence[int], tokens_per_batch: int, seed: int, epoch: int) -> list[list[int]]:
    """The micro-batches of one epoch (every rank computes the same list)."""
    return make_batches(lengths, tokens_per_batch, seed * 1_000_003 + epoch)


def check_enough_for_a_step(lengths: Sequence[int], *, tokens_per_batch: int, seed: int,
                            world: int, accum: int, what: str = "the store's") -> int:
    """Optimizer steps in the first epoch for training samples of these lengths; a ValueError
    saying what to change when it is 0 (checked by the driver, before any Ray worker starts)."""
    n = len(epoch_batches(lengths, tokens_per_batch, seed, 0))
    need = world * accum
    if n < need:
        raise ValueError(
            f"not enough training data for one optimizer step: {what} {len(lengths)} training "
            f"samples ({sum(lengths):,} tokens) make {n} micro-batch(es) of <= {tokens_per_batch:,} "
            f"tokens, and one step needs train.num_workers x train.grad_accum = {world} x {accum} "
            f"= {need}. Extract more samples, or lower train.num_workers / train.grad_accum / "
            f"train.tokens_per_batch (e.g. --set train.num_workers={max(1, min(world, n))} "
            "--set train.grad_accum=1)")
    return n // need


class RankBatches:
    """The micro-batches of one rank for one epoch: global batch g = step * world * accum + i
    goes to rank (i // accum) as its (i % accum)-th micro-batch, so W workers x A accum steps
    see the same global batches as 1 worker x (W*A) accum steps. Needs only the samples'
    lengths: the same plan whether features come from a store or from online extraction."""

    def __init__(self, lengths: Sequence[int], ids: Sequence[str], *, tokens_per_batch: int,
                 seed: int, epoch: int, rank: int, world: int, accum: int):
        batches = epoch_batches(lengths, tokens_per_batch, seed, epoch)
        self.steps = len(batches) // (world * accum)  # drop the ragged tail: ranks step together
        self.ids, self.batches = list(ids), batches
        self.rank, self.world, self.accum = rank, world, accum

    def micro_batches(self, step: int) -> list[list[str]]:
        base = step * self.world * self.accum + self.rank * self.accum
        return [[self.ids[i] for i in self.batches[base + k]] for k in range(self.accum)]


class Prefetcher:
    """Loads the next steps' micro-batches on a thread while the current step computes
    (`load(ids) -> batch`); records how long the training loop waited for data."""

    def __init__(self, rb: RankBatches, start_step: int, load, depth: int = 2):
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.wait_s = 0.0
        self._t = threading.Thread(target=self._run, args=(rb, start_step, load), daemon=True)
        self._t.start()

    def _run(self, rb: RankBatches, start: int, load) -> None:
        try:
            for step in range(start, rb.steps):
                self.q.put((step, [load(mb) for mb in rb.micro_batches(step)]))
        except BaseException as e:  # surface loader errors in the training loop
            self.q.put(e)
            return
        self.q.put(None)

    def __iter__(self) -> Iterator[tuple[int, list[dict[str, torch.Tensor]]]]:
        while True:
            t0 = time.perf_counter()
            item = self.q.get()
            self.wait_s += time.perf_counter() - t0
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
