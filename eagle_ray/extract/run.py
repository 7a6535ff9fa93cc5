"""Extraction run: Ray Data streams conversations through a pool of extractor actors.

    conversations.parquet (or a Ray Dataset from generation)
        ─▶ filter: sample ids not yet committed in the store (resume)
        ─▶ map_batches(ExtractUDF, ActorPoolStrategy(min_size..max_size))   autoscaling pool
               each call: prefill, capture, write shard + commit index part
        ─▶ driver: progress (samples, tokens/s), final summary; store verify-able at any time

Scaling: the pool grows from min_size to max_size on its own when resources free up
(e.g. GPUs released by generation) or nodes join (cluster autoscaler); Ray Data cannot
change a running pool's bounds, so to change the bounds stop the run and re-run it with
`--set extract.max_replicas=N`: it resumes exactly where it stopped (committed samples
are skipped, uncommitted ones redone), without losing or duplicating a sample.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from eagle_ray.config import Recipe
from eagle_ray.targets.resolve import resolve_target_path
from eagle_ray.extract.stage import CAPTURE_COLUMNS, INPUT_COLUMNS, ExtractUDF, with_mask_column
from eagle_ray.common.provenance import target_fingerprint, tokenizer_fingerprint
from eagle_ray.store.format import StoreManifest
from eagle_ray.store.reader import committed_ids
from eagle_ray.common.outputs import check_output_dir, claim_output_dir
from eagle_ray.store.lock import store_lock
from eagle_ray.store.writer import open_or_create, sweep_interrupted
from eagle_ray.common.tables import read_stage_table

logger = logging.getLogger(__name__)


@dataclass
class ExtractResult:
    store: Path
    samples_total: int
    skipped_done: int
    extracted: int
    tokens: int
    seconds: float

    def summary_line(self) -> str:
        """`eagle-ray extract`'s line."""
        return (f"extract: {self.extracted:,} samples ({self.tokens:,} tokens) written, "
                f"{self.skipped_done:,} were already in the store -> {self.store} in {self.seconds:.1f}s")


def generation_provenance(gen_dir: Path) -> dict | None:
    """What a store records of the conversations it was extracted from (the generate
    manifest's mode, sampling, target, vLLM version), None without a manifest."""
    import json

    path = Path(gen_dir) / "manifest.json"
    if not path.exists():
        return None
    g = json.loads(path.read_text())
    return {k: g.get(k) for k in ("mode", "sampling", "serving_profile", "target", "vllm_version")}


def make_manifest(recipe: Recipe, model_dir: Path, generation: dict | None = None) -> StoreManifest:
    t = recipe.target
    return StoreManifest(
        target_path=t.path, target_revision=t.revision,
        target_fingerprint=target_fingerprint(model_dir), architecture=t.architecture,
        hidden_size=t.hidden_size, num_layers=t.num_layers, vocab_size=t.vocab_size,
        aux_layer_ids=t.resolved_aux_layer_ids, dtype=recipe.storage.dtype,
        max_seq_len=recipe.data.max_seq_len, tokenizer_fingerprint=tokenizer_fingerprint(model_dir),
        generation=generation)


def check_target_shape(recipe: Recipe, model_dir: Path) -> None:
    """The recipe's architecture numbers must describe the model on disk, and its training
    window must fit the capture engine."""
    import json

    n, limit = recipe.data.max_seq_len, recipe.engine.max_model_len
    if recipe.extract.backend == "vllm" and limit is not None and n >= limit:
        # vLLM's capture is a prefill plus one generated token: a full window needs n + 1.
        raise ValueError(f"data.max_seq_len={n} does not fit the capture engine's engine.max_model_len="
                         f"{limit} (a window of n tokens needs n + 1): set data.max_seq_len below "
                         f"{limit} or engine.max_model_len above {n}")
    cfg_path = model_dir / "config.json"
    if not cfg_path.exists():
        return
    cfg = json.loads(cfg_path.read_text())
    cfg = cfg.get("text_config", cfg)
    got = {"hidden_size": cfg.get("hidden_size"), "num_layers": cfg.get("num_hidden_layers"),
           "vocab_size": cfg.get("vocab_size")}
    want = {k: getattr(recipe.target, k) for k in got}
    bad = {k: (want[k], got[k]) for k in got if got[k] is not None and got[k] != want[k]}
    if bad:
        raise ValueError(f"recipe {recipe.name} says {', '.join(f'{k}={a}' for k, (a, _) in bad.items())} "
                         f"but {model_dir} has {', '.join(f'{k}={b}' for k, (_, b) in bad.items())}")


def extraction_dataset(recipe: Recipe, ds, store_dir: Path, model_dir: Path,
                       manifest: StoreManifest):
    """Map a Ray Dataset of conversation rows to committed index rows (lazy, streaming)."""
    import ray

    from eagle_ray.vllm.engine import check_gpus_available, pool_kwargs

    e = recipe.extract
    if e.backend == "vllm":
        check_gpus_available(recipe, e.gpus_per_replica)
        kw = pool_kwargs(recipe, min_size=e.min_replicas, max_size=e.max_replicas,
                         gpus_per_replica=e.gpus_per_replica, batch_size=e.batch_size,
                         num_cpus=e.num_cpus_per_replica)
    else:
        kw = dict(compute=ray.data.ActorPoolStrategy(min_size=e.min_replicas, max_size=e.max_replicas),
                  batch_size=e.batch_size, batch_format="pyarrow",
                  num_cpus=e.num_cpus_per_replica, num_gpus=min(e.gpus_per_replica, 1))
    return ds.map_batches(ExtractUDF, fn_constructor_args=(recipe, str(model_dir), str(store_dir),
                                                           manifest), **kw)


def run_extract(recipe: Recipe, conversations: str | Path, store_dir: str | Path, *,
                limit: int | None = None) -> ExtractResult:
    """Extract every conversation not yet in the store; resumable and idempotent."""
    t0 = time.time()
    conv_file, table = read_stage_table(conversations, "conversations.parquet", INPUT_COLUMNS,
                                        "generate")
    if limit is not None:
        table = table.slice(0, limit)
    generation = generation_provenance(conv_file.parent)

    store = check_output_dir(store_dir, "extract")  # refused before anything is written
    model_dir = resolve_target_path(recipe.target)
    check_target_shape(recipe, model_dir)
    manifest = make_manifest(recipe, model_dir, generation)
    # One writer per store: a second extract (or a repair, or a training run reading it)
    # refuses instead of committing the same samples twice.
    claim_output_dir(store, "extract")
    with store_lock(store, exclusive=True, command="eagle-ray extract"):
        open_or_create(store, manifest)  # refuses a store written for other features
        sweep_interrupted(store)  # what a killed run left uncommitted
        return _extract_into(recipe, table, store, model_dir, manifest, t0)


def drain_committed(recipe: Recipe, ds, manifest: StoreManifest, label: str, total: int, start: int,
                    log: logging.Logger, ended=None) -> tuple[int, int]:
    """Run an extraction dataset to its end, counting, recording (dashboard metrics) and
    reporting progress of the committed rows it yields: (samples, tokens) this run.
    `ended`: a callable counting the samples of `total` that will never commit (a streamed
    run's rejected generations), shown beside the committed ones."""
    from eagle_ray.common.progress import Progress
    from eagle_ray.ops.metrics import record_committed
    from eagle_ray.plan.budget import store_bytes_per_token

    n = n_tok = 0
    per_tok = store_bytes_per_token(recipe.target, recipe.storage.dtype)
    prog = Progress(label, total, start=start, interval_s=recipe.generate.progress_interval_s, logger=log,
                    ended=ended)
    for rows in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        n += rows.num_rows
        tok = pc.sum(rows.column("num_tokens")).as_py() or 0
        n_tok += tok
        record_committed(rows, manifest)
        prog.update(rows.num_rows, tokens=tok, bytes=tok * per_tok)
    prog.close()
    return n, n_tok


def _extract_into(recipe: Recipe, table, store: Path, model_dir: Path, manifest: StoreManifest,
                  t0: float) -> ExtractResult:
    import ray

    from eagle_ray.plan.budget import check_budget

    done = committed_ids(store)
    todo = table.filter(pc.invert(pc.is_in(table.column("sample_id"), value_set=done)))
    n_tokens = pc.sum(pc.min_element_wise(
        pc.add(table.column("num_prompt_tokens"), table.column("num_completion_tokens")),
        recipe.data.max_seq_len)).as_py() or 0
    skipped = table.num_rows - todo.num_rows
    logger.info("extract: %d conversations, %d already in %s, %d to go (backend %s, %d..%d replicas)",
                table.num_rows, skipped, store, todo.num_rows, recipe.extract.backend,
                recipe.extract.min_replicas, recipe.extract.max_replicas)
    extracted = tokens = 0
    if todo.num_rows:
        todo_tokens = int(n_tokens * todo.num_rows / max(1, table.num_rows))
        check_budget(recipe, num_samples=todo.num_rows,
                     avg_tokens=max(1.0, todo_tokens / todo.num_rows), out_dir=store)
        from eagle_ray.ops.cluster import init_ray

        init_ray()
        from eagle_ray.ops.control import start_control

        start_control()  # `eagle-ray scale` resizes this run's pools while it runs
        e = recipe.extract
        todo = with_mask_column(todo).select(list(CAPTURE_COLUMNS))
        blocks = [todo.slice(i, e.batch_size) for i in range(0, todo.num_rows, e.batch_size)]
        ds = extraction_dataset(recipe, ray.data.from_arrow(blocks), store, model_dir, manifest)
        extracted, tokens = drain_committed(recipe, ds, manifest, "extract", table.num_rows, skipped, logger)
    logger.info("extract: %d samples, %d tokens this run in %.1fs -> %s", extracted, tokens,
                time.time() - t0, store)
    return ExtractResult(store=store, samples_total=table.num_rows, skipped_done=skipped,
                         extracted=extracted, tokens=tokens, seconds=time.time() - t0)
