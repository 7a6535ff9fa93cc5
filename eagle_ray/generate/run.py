"""Generation run: Ray Data streams prompts through a pool of vLLM replicas.

    prompts.parquet ─▶ ray.data (blocks of batch_size) ─▶ map_batches(GenerateUDF, actor pool
    min..max replicas) ─▶ driver: each finished batch -> parts/part-*.parquet (atomic)
                                                    ─▶ conversations.parquet + rejects.jsonl + manifest.json

Resumable: a sample id that is in any part (generated or rejected) is not sent again, so a
killed run loses at most the batches in flight; parts are renamed into place only when
complete, so there is never a half-written one. `generation_dataset` is the library entry
that returns the Ray Dataset for chaining into extraction without a disk round trip.
"""

from __future__ import annotations

import json
import os
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle_ray.config import Recipe
from eagle_ray.targets.resolve import resolve_target_path
from eagle_ray.targets.serving import generation_sampling, serving_profile
from eagle_ray.generate.stage import CONVERSATIONS_SCHEMA, INPUT_COLUMNS, GenerateUDF, LoggedUDF
from eagle_ray.common.outputs import claim_output_dir
from eagle_ray.common.tables import read_stage_table
from eagle_ray.common.provenance import (atomic_write_bytes, atomic_write_json, atomic_write_parquet,
                                         provenance, target_fingerprint)

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
CONVERSATIONS_FILE = "conversations.parquet"
REJECTS_FILE = "rejects.jsonl"
MANIFEST_FILE = "manifest.json"
PARAMS_FILE = "generate_params.json"
PARTS_DIR = "parts"


@dataclass
class GenerateResult:
    out_dir: Path
    prompts: int
    generated: int
    rejected: int
    skipped_done: int
    completion_tokens: int
    seconds: float


def _read_prompts(prompts: str | Path) -> pa.Table:
    _, table = read_stage_table(prompts, "prompts.parquet", INPUT_COLUMNS, "ingest")
    return table.select(list(INPUT_COLUMNS))


def generation_params(recipe: Recipe, model_dir: Path) -> dict:
    """What decides the outputs; a resumed run must match it exactly."""
    g = recipe.generate
    profile = serving_profile(recipe, model_dir)
    return {
        "mode": g.mode,
        "target": {"path": recipe.target.path, "resolved_path": str(model_dir),
                   "revision": recipe.target.revision,
                   "fingerprint": target_fingerprint(model_dir)},
        # The sampling generation draws at (generate.* else the serving profile) and the
        # serving profile itself: a drafter is traced to both.
        "sampling": ({**generation_sampling(recipe, model_dir, profile), "max_tokens": g.max_tokens}
                     if g.mode == "regenerate" else None),
        "serving_profile": profile,
        "engine": {"dtype": recipe.engine.dtype, "max_model_len": recipe.engine.max_model_len,
                   "tensor_parallel_size": recipe.target.tensor_parallel_size},
        "max_seq_len": recipe.data.max_seq_len,
    }


def generation_dataset(recipe: Recipe, prompts: pa.Table, model_dir: Path):
    """A Ray Dataset of CONVERSATIONS_SCHEMA rows for the given prompt rows (lazy, streaming)."""
    import ray

    from eagle_ray.vllm.engine import check_gpus_available, pool_kwargs

    g = recipe.generate
    # One block per batch so replicas share the work from the start.
    blocks = [prompts.slice(i, g.batch_size) for i in range(0, prompts.num_rows, g.batch_size)]
    ds = ray.data.from_arrow(blocks or [prompts])
    if g.mode == "keep_logged":
        return ds.map_batches(LoggedUDF, fn_constructor_args=(recipe, str(model_dir)),
                              compute=ray.data.ActorPoolStrategy(min_size=1, max_size=1),
                              batch_size=g.batch_size, batch_format="pyarrow",
                              num_cpus=recipe.engine.num_cpus_per_replica)
    check_gpus_available(recipe, g.gpus_per_replica)
    return ds.map_batches(GenerateUDF, fn_constructor_args=(recipe, str(model_dir)),
                          **pool_kwargs(recipe, min_size=g.min_replicas, max_size=g.max_replicas,
                                        gpus_per_replica=g.gpus_per_replica,
                                        batch_size=g.batch_size,
                                        num_cpus=recipe.engine.num_cpus_per_replica,
                                        max_concurrency=g.batches_in_flight, child_engine=True))


DAMAGED_DIR = "damaged"  # parts/damaged/: parts that no longer read, kept for inspection


def readable_parts(parts_dir: Path) -> list[Path]:
    """The parts in parts_dir, after moving any that no longer read (truncated or overwritten
    on disk: parts are written atomically, so only damage makes one) to parts/damaged/, with a
    warning: their prompts are simply not done, and this run generates them again."""
    parts = sorted(parts_dir.glob("part-*.parquet"))
    good = []
    for f in parts:
        try:
            pq.read_metadata(f)
            pq.read_table(f, columns=["sample_id"])
        except (OSError, pa.ArrowException) as e:
            dest = parts_dir / DAMAGED_DIR / f.name
            dest.parent.mkdir(exist_ok=True)
            os.replace(f, dest)
            logger.warning("generate: %s does not read (%s); moved to %s, its prompts are "
                           "generated again", f, str(e).splitlines()[0][:120], dest)
            continue
        good.append(f)
    return good


def _done_ids(parts_dir: Path) -> set[str]:
    """Ids of the PROMPTS done in parts_dir: all completions of a prompt are written in one
    part (one batch), so a prompt is done when any of its rows is there."""
    from eagle_ray.data.ids import prompt_id

    done: set[str] = set()
    for f in readable_parts(parts_dir):
        done.update(map(prompt_id, pq.read_table(f, columns=["sample_id"]).column("sample_id").to_pylist()))
    return done


def _check_params(out: Path, params: dict) -> None:
    path = out / PARAMS_FILE
    if path.exists():
        old = json.loads(path.read_text())
        if old != params:
            diff = {k: (old.get(k), params.get(k)) for k in params if old.get(k) != params.get(k)}
            raise ValueError(
                f"{out} holds a generation run with other parameters ({diff}); resuming would mix "
                "two distributions. Use a new --out directory, or the same recipe and --set values")
    else:
        atomic_write_json(path, params)


def run_generate(recipe: Recipe, prompts: str | Path, out_dir: str | Path, *,
                 limit: int | None = None) -> GenerateResult:
    """Generate conversations for every prompt not yet done in out_dir, then consolidate."""
    t0 = time.time()
    out = Path(out_dir)
    parts_dir = out / PARTS_DIR
    table = _read_prompts(prompts)
    if limit is not None:
        table = table.slice(0, limit)
    model_dir = resolve_target_path(recipe.target)
    claim_output_dir(out, "generate")  # new, empty or an earlier generate output; else refused
    parts_dir.mkdir(parents=True, exist_ok=True)
    params = generation_params(recipe, model_dir)
    _check_params(out, params)

    done = _done_ids(parts_dir)
    todo = table.filter(pc.invert(pc.is_in(table.column("sample_id"), pa.array(sorted(done), pa.string()))))
    skipped = table.num_rows - todo.num_rows
    logger.info("generate: %d prompts, %d already done in %s, %d to go (mode %s)",
                table.num_rows, skipped, out, todo.num_rows, recipe.generate.mode)

    n_ok = n_rej = n_tok = 0
    if todo.num_rows:
        from eagle_ray.ops.cluster import init_ray

        init_ray()
        from eagle_ray.ops.control import start_control

        start_control()  # `eagle-ray scale` resizes this run's pools while it runs
        ds = generation_dataset(recipe, todo, model_dir)
        from eagle_ray.common.progress import Progress

        prog = Progress("generate", table.num_rows, unit="prompts", start=skipped,
                        interval_s=recipe.generate.progress_interval_s, logger=logger)
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            if batch.num_rows == 0:
                continue
            batch = batch.cast(CONVERSATIONS_SCHEMA)
            atomic_write_parquet(parts_dir / f"part-{time.time_ns()}-{uuid.uuid4().hex[:8]}.parquet", batch)
            ok = pc.equal(batch.column("status"), "ok")
            n_ok += pc.sum(ok).as_py() or 0
            n_rej += batch.num_rows - (pc.sum(ok).as_py() or 0)
            tok = pc.sum(batch.column("num_completion_tokens")).as_py() or 0
            n_tok += tok
            prog.update(batch.num_rows, tokens=tok, extra=f"{n_rej:,} rejected")
        prog.close()
    logger.info("generate: this run generated %d, rejected %d, %d completion tokens in %.1fs",
                n_ok, n_rej, n_tok, time.time() - t0)
    counts = consolidate(out, table, params)
    return GenerateResult(out_dir=out, prompts=table.num_rows, generated=counts["ok"],
                          rejected=counts["rejected"], skipped_done=skipped,
                          completion_tokens=n_tok, seconds=time.time() - t0)


def consolidate(out: Path, prompts: pa.Table, params: dict) -> dict[str, int]:
    """Parts -> conversations.parquet (prompt order, then completion index), rejects.jsonl,
    manifest.json; atomic."""
    from eagle_ray.data.ids import completion_index, prompt_id

    parts = readable_parts(out / PARTS_DIR)
    all_rows = (pa.concat_tables([pq.read_table(f, schema=CONVERSATIONS_SCHEMA) for f in parts])
                if parts else CONVERSATIONS_SCHEMA.empty_table())
    ids = all_rows.column("sample_id").to_pylist()
    if len(set(ids)) != len(ids):  # cannot happen by construction; never ship duplicates
        raise AssertionError(f"{len(ids) - len(set(ids))} duplicate sample ids across parts in {out}")
    order = {sid: i for i, sid in enumerate(prompts.column("sample_id").to_pylist())}
    extra = [sid for sid in ids if prompt_id(sid) not in order]
    if extra:
        raise ValueError(f"{out} holds {len(extra)} samples that are not in these prompts "
                         f"(e.g. {extra[0]}); it belongs to another prompt set")
    n = params["sampling"]["samples_per_prompt"] if params.get("sampling") else 1
    # prompt order, then completion index (ids "<prompt>#<j>")
    rank = pa.array([order[prompt_id(sid)] * n + completion_index(sid) for sid in ids], pa.int64())
    all_rows = all_rows.append_column("_rank", rank).sort_by("_rank").drop(["_rank"])
    is_ok = pc.equal(all_rows.column("status"), "ok")
    ok = all_rows.filter(is_ok)
    rej = all_rows.filter(pc.invert(is_ok))
    atomic_write_parquet(out / CONVERSATIONS_FILE, ok)
    lines = [json.dumps({"sample_id": r["sample_id"], "source": r["source"], "reason": r["reason"],
                         "message": r["message"]}, ensure_ascii=False)
             for r in rej.select(["sample_id", "source", "reason", "message"]).to_pylist()]
    atomic_write_bytes(out / REJECTS_FILE, "".join(l + "\n" for l in lines).encode())
    counts = {"prompts": prompts.num_rows, "samples_per_prompt": n, "ok": ok.num_rows,
              "rejected": rej.num_rows, "pending": prompts.num_rows * n - all_rows.num_rows}
    import vllm  # version of the engine that produced the outputs

    manifest = {"schema_version": SCHEMA_VERSION, "stage": "generate", **params,
                "vllm_version": vllm.__version__, "counts": counts,
                "completion_tokens": int(pc.sum(ok.column("num_completion_tokens")).as_py() or 0),
                "finish_reasons": {r["values"]: r["counts"] for r in
                                   pc.value_counts(ok.column("finish_reason")).to_pylist()},
                "provenance": provenance()}
    atomic_write_json(out / MANIFEST_FILE, manifest)
    return counts
