"""Extractor actor: conversations -> target prefill -> aux + final features -> store shard.

Each call takes one batch of conversation rows, runs the target's prefill over
`prompt_token_ids + completion_token_ids` (end-truncated at max_seq_len), captures the
features (vLLM or HF backend, same interface), writes them as ONE shard + index part
straight to the store (actors write to shared storage; features never travel through the
object store to the driver), and returns the committed index rows, which are small.

Token/feature alignment for a sample of T tokens (loss on the completion):

    input_ids   p0 p1 .. pk-1 | c0 c1 .. cm-1        (T = min(k + m, max_seq_len))
    loss_mask    0  0 ..  0   |  1  1 ..  1
    aux[t]      features of the prefix ending at token t (layer inputs at position t)
    final[t]    normed last-layer state at t: lm_head(final[t]) predicts token t+1
"""

from __future__ import annotations

import functools
import logging

from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from pathlib import Path

import pyarrow.parquet as pq

from eagle_ray.store.format import INDEX_DIR, INDEX_SCHEMA, StoreManifest
from eagle_ray.store.writer import SampleFeatures, StoreWriter

logger = logging.getLogger(__name__)

INPUT_COLUMNS = ("sample_id", "source", "prompt_token_ids", "completion_token_ids")
MASK_COLUMN = "completion_loss_mask"
"""Which completion tokens are in the loss; null: all of them. data.train_turns=all sets it:
the completion then runs from the first assistant turn to the end, and the user turns and
tool results inside it are masked out."""
CAPTURE_COLUMNS = INPUT_COLUMNS + (MASK_COLUMN,)


def with_mask_column(table: pa.Table) -> pa.Table:
    """The table with MASK_COLUMN, all null where it has none (train_turns=last outputs)."""
    if MASK_COLUMN in table.column_names:
        return table
    return table.append_column(MASK_COLUMN, pa.nulls(table.num_rows, pa.list_(pa.bool_())))


def window(prompt_ids: list[int], completion_ids: list[int], max_seq_len: int,
           completion_mask: list[bool] | None = None):
    """(input_ids [T] int32, loss_mask [T] bool, untruncated length): end-truncation."""
    ids = np.asarray(list(prompt_ids) + list(completion_ids), dtype=np.int32)
    mask = _mask(len(prompt_ids), len(completion_ids), completion_mask)
    return ids[:max_seq_len], mask[:max_seq_len], len(ids)


def _mask(n_prompt: int, n_completion: int, completion_mask) -> np.ndarray:
    mask = np.zeros(n_prompt + n_completion, dtype=bool)
    if completion_mask is None:
        mask[n_prompt:] = True
    else:
        if len(completion_mask) != n_completion:
            raise ValueError(f"{MASK_COLUMN} has {len(completion_mask)} entries for "
                             f"{n_completion} completion tokens")
        mask[n_prompt:] = np.asarray(completion_mask, dtype=bool)
    return mask


class Windows(Mapping):
    """sample id -> (input_ids, loss_mask, untruncated length) of every ok conversation: the
    training window exactly as `eagle-ray extract` cuts it (`window`), built when asked for.
    The token lists stay in Arrow buffers (a million conversations are not a million Python
    lists of ints on every training rank); lengths are numpy. A repeated id keeps its last
    row, in its first place, as a dict built row by row would."""

    def __init__(self, table: pa.Table, max_seq_len: int):
        import pyarrow.compute as pc

        self._max = int(max_seq_len)
        ids = table.column("sample_id").to_pylist()
        self._row = {sid: i for i, sid in enumerate(ids)}
        self._p_off, self._p = self._flat(table.column("prompt_token_ids"))
        self._c_off, self._c = self._flat(table.column("completion_token_ids"))
        # Per-row completion masks (None: all in the loss), kept only where a row has one.
        self._m = ({i: m for i, m in enumerate(table.column(MASK_COLUMN).to_pylist()) if m is not None}
                   if MASK_COLUMN in table.column_names else {})
        n = (pc.list_value_length(table.column("prompt_token_ids")).to_numpy(zero_copy_only=False)
             .astype(np.int64) + pc.list_value_length(table.column("completion_token_ids"))
             .to_numpy(zero_copy_only=False).astype(np.int64)) if table.num_rows else np.zeros(0, np.int64)
        self._n = n

    @staticmethod
    def _flat(col) -> tuple[np.ndarray, np.ndarray]:
        arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        arr = arr.fill_null([]) if arr.null_count else arr
        offs = arr.offsets.to_numpy().astype(np.int64)
        return offs - offs[0] if len(offs) else offs, arr.flatten().to_numpy(zero_copy_only=False)

    def __getitem__(self, sid: str) -> tuple[list[int], list[bool], int]:
        i = self._row[sid]
        p = self._p[self._p_off[i]:self._p_off[i + 1]]
        c = self._c[self._c_off[i]:self._c_off[i + 1]]
        ids = np.concatenate([p, c]).astype(np.int32)
        mask = _mask(len(p), len(c), self._m.get(i))
        return ids[:self._max].tolist(), mask[:self._max].tolist(), int(self._n[i])

    def length(self, sid: str) -> int:
        """len(self[sid][0]) without building the window."""
        return int(min(self._n[self._row[sid]], self._max))

    def __contains__(self, sid) -> bool:
        return sid in self._row

    def __iter__(self):
        return iter(self._row)

    def __len__(self) -> int:
        return len(self._row)


def read_windows(conversations: str | Path, max_seq_len: int) -> Windows:
    """The `Windows` of every ok conversation in conversations.parquet (or its directory).
    Online training and the runtime check of an online-trained drafter read these instead
    of a store."""
    import pyarrow.compute as pc

    path = Path(conversations)
    if path.is_dir():
        path = path / "conversations.parquet"
    cols = ["sample_id", "status", "prompt_token_ids", "completion_token_ids"]
    if MASK_COLUMN in pq.read_schema(path).names:
        cols.append(MASK_COLUMN)
    t = pq.read_table(path, columns=cols)
    t = t.filter(pc.equal(t.column("status"), "ok"))
    return Windows(t, max_seq_len)


def decode_window(sample_id: str, encoded: dict, windows: dict) -> dict:
    """One sample as a store read returns it (`store.reader.decode`), from its features
    encoded in the storage dtype (`store.writer.encode`) and its window (`read_windows`)."""
    import torch

    from eagle_ray.store.reader import decode

    tok, mask, _ = windows[sample_id]
    if encoded["aux"].shape[0] != len(tok):
        raise RuntimeError(f"extractor returned {encoded['aux'].shape[0]} positions for sample "
                           f"{sample_id} of {len(tok)} tokens")
    return decode({**encoded, "input_ids": torch.tensor(tok), "loss_mask": torch.tensor(mask)})


def make_backend(recipe, model_path: str):
    e, t = recipe.extract, recipe.target
    aux = t.resolved_aux_layer_ids
    if e.backend == "hf":
        from eagle_ray.extract.hf_capture import HFCapture

        import torch

        device = "cuda" if e.gpus_per_replica > 0 and torch.cuda.is_available() else "cpu"
        dtype = recipe.engine.dtype if recipe.engine.dtype != "auto" else "bfloat16"
        return HFCapture(model_path, aux, device=device, dtype=dtype, revision=t.revision,
                         trust_remote_code=t.trust_remote_code)
    from eagle_ray.vllm.engine import engine_kwargs
    from eagle_ray.extract.vllm_capture import VllmCapture

    kw = engine_kwargs(recipe, model_path)
    kw.pop("model")
    kw["enable_prefix_caching"] = e.prefix_caching
    return VllmCapture(model_path, aux, kw)


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim(0)`; elsewhere a no-op).

    Every capture allocates and frees a few MB of features whose sizes differ from batch to
    batch; glibc keeps the freed chunks in its heap (its mmap threshold rises after the first
    large frees), so an extractor's RSS grew through a run: 3.5 -> 4.5 GiB from sample 400 to 1,525
    of SmolLM2, past the memory it asks Ray for, and Ray Data warned. Trimming after every
    batch cut the growth from ~1.3 to ~0.3 MiB a sample (`bench/bench_capture_memory.py`)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, looked up once per process (None where there is none)."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


class ExtractUDF:
    """Ray Data actor: one backend (model loaded once) and one store writer per actor."""

    def __init__(self, recipe, model_path: str, store_dir: str, manifest: StoreManifest,
                 backend=None):
        self.recipe = recipe
        self.store_dir = store_dir
        # `backend`: an engine built by the caller (the colocated stage shares its own).
        self.backend = backend if backend is not None else make_backend(recipe, model_path)
        self.writer = StoreWriter(store_dir, manifest, shard_bytes=recipe.storage.shard_bytes)
        self._seen_parts: set[str] = set()
        self._done: set[str] = set()

    def _committed(self) -> set[str]:
        """Sample ids committed by any writer so far (reads only index files not seen yet;
        a compact file repeats ids of parts already seen, which the set absorbs)."""
        d = Path(self.store_dir) / INDEX_DIR
        for p in sorted(d.glob("compact-*.parquet")) + sorted(d.glob("part-*.parquet")):
            if p.name not in self._seen_parts:
                try:
                    ids = pq.read_table(p, columns=["sample_id"]).column(0).to_pylist()
                except FileNotFoundError:
                    continue  # merged away meanwhile: its compact file is read now or next call
                self._seen_parts.add(p.name)
                self._done.update(ids)
        return self._done

    def __call__(self, batch: pa.Table) -> pa.Table:
        from eagle_ray.ops.metrics import InFlight

        with InFlight("extract"):
            return self._extract(batch)

    def _extract(self, batch: pa.Table) -> pa.Table:
        cols = {c: batch.column(c).to_pylist() for c in INPUT_COLUMNS}
        # A retried batch (actor died after committing) must not commit its samples twice.
        done = self._committed()
        keep = [i for i, sid in enumerate(cols["sample_id"]) if sid not in done]
        if not keep:
            return INDEX_SCHEMA.empty_table()
        masks = (batch.column(MASK_COLUMN).to_pylist() if MASK_COLUMN in batch.column_names
                 else [None] * batch.num_rows)
        windows = [window(cols["prompt_token_ids"][i], cols["completion_token_ids"][i],
                          self.recipe.data.max_seq_len, masks[i]) for i in keep]
        feats = self.backend.capture([w[0].tolist() for w in windows])
        samples = [SampleFeatures(sample_id=cols["sample_id"][i], source=cols["source"][i],
                                  input_ids=ids, loss_mask=mask, aux=aux, final=final,
                                  num_tokens_untruncated=n)
                   for i, (ids, mask, n), (aux, final) in zip(keep, windows, feats)]
        rows = self.writer.write_shard(samples)
        del samples, feats
        release_freed_memory()
        return rows
