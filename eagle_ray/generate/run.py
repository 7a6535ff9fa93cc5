"""Generation run: Ray Data streams prompts through a pool of vLLM replicas.

    prompts.parquet ─▶ read tasks (generate/prompts.py: blocks of batch_size, less the
    prompts done) ─▶ map_batches(GenerateUDF, actor pool min..max replicas) ─▶ driver: each
    finished batch -> parts/part-*.parquet (atomic; every 64 merged into a compact file)
                                                    ─▶ conversations.parquet + rejects.jsonl + manifest.json

Resumable: a sample id that is in any part (generated or rejected) is not sent again, so a
killed run loses at most the batches in flight; parts are renamed into place only when
complete, so there is never a half-written one. The driver never holds the prompt set:
prompts are read on the workers, and resume bookkeeping is Arrow work on id columns.
`generation_dataset` is the library entry that returns the Ray Dataset for chaining into
extraction without a disk round trip.
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
from eagle_ray.common.tables import stage_file
from eagle_ray.common.atomic import AtomicFile, atomic_write_bytes, atomic_write_json, atomic_write_parquet
from eagle_ray.common.provenance import provenance, target_fingerprint

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

    def summary_line(self) -> str:
        """`eagle-ray generate`'s line, and the online job's."""
        return (f"generate: {self.generated:,} conversations, {self.rejected:,} rejected "
                f"({self.skipped_done:,} were already done) -> {self.out_dir}/conversations.parquet "
                f"in {self.seconds:.1f}s")


def prompts_file(prompts: str | Path) -> Path:
    """The ingest output to generate from (its schema checked; no row read)."""
    return stage_file(prompts, "prompts.parquet", INPUT_COLUMNS, "ingest")


def expected_samples(recipe: Recipe, file: Path) -> int:
    """The samples generation draws from a prompts file: N = generate.samples_per_prompt a
    prompt, or N a logged turn when every turn is regenerated (ingest's `turn_tokens`, which
    the plan counted; the prompt count where the file has none)."""
    from eagle_ray.data.tokenize import TURNS_COLUMN

    n = recipe.generate.samples_per_prompt if recipe.generate.mode == "regenerate" else 1
    f = pq.ParquetFile(file)
    if recipe.regenerates_every_turn and TURNS_COLUMN in f.schema_arrow.names:
        turns = f.read(columns=[TURNS_COLUMN]).column(0)
        return n * int(pc.sum(pc.list_value_length(turns)).as_py() or 0)
    return n * f.metadata.num_rows


def check_prompts_render(recipe: Recipe, file: Path) -> None:
    """Refuse, before an engine starts, prompts with tools for a target whose chat template
    cannot render them (data/chat.py); reads the tools column only."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    tools = pq.read_table(file, columns=["tools"]).column("tools")
    if pc.all(pc.is_null(tools)).as_py() is not False:
        return
    from eagle_ray.data.chat import check_renders_tools
    from eagle_ray.data.tokenize import load_tokenizer

    check_renders_tools(load_tokenizer(recipe.target), recipe.target.path)


def prompt_rows(recipe: Recipe, prompts: Path, exclude: pa.Array | None = None,
                limit: int | None = None):
    """A Ray Dataset of the prompts' INPUT_COLUMNS in blocks of generate.batch_size, less the
    ids in `exclude`, read on the workers."""
    from eagle_ray.generate.prompts import ParquetRows, dataset

    return dataset(ParquetRows([prompts], list(INPUT_COLUMNS), block_rows=recipe.generate.batch_size,
                               exclude=exclude, limit=limit))


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
        # Every logged assistant turn regenerated (samples `<prompt>#<t * N + j>`); absent for
        # the final turn only, so earlier runs' parameters still match
        **({"train_turns": "all"} if recipe.regenerates_every_turn else {}),
    }


def generation_dataset(recipe: Recipe, prompts, model_dir: Path):
    """A Ray Dataset of CONVERSATIONS_SCHEMA rows for the given prompts (lazy, streaming):
    a Ray Dataset of prompt rows (`prompt_rows`) or, for library use, an Arrow table."""
    import ray

    from eagle_ray.vllm.engine import check_gpus_available, pool_kwargs

    g = recipe.generate
    if isinstance(prompts, pa.Table):
        # One block per batch so replicas share the work from the start.
        blocks = [prompts.slice(i, g.batch_size) for i in range(0, prompts.num_rows, g.batch_size)]
        ds = ray.data.from_arrow(blocks or [prompts])
    else:
        ds = prompts
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


def read_parts(parts_dir: Path) -> list[tuple[Path, pa.Table]]:
    """The live files in parts_dir (compact files, then parts no compact file replaces) with
    their `sample_id` and `status` columns, the one read all resume bookkeeping works on,
    after moving any that no longer read (truncated or overwritten on disk: files are
    written atomically, so only damage makes one) to parts/damaged/, with a warning: their
    prompts are simply not done, and this run generates them again."""
    from eagle_ray.store.compact import finish_dir, live_files

    finish_dir(parts_dir)  # a compaction a crash interrupted
    good = []
    for f in live_files(parts_dir):
        try:
            ids = pq.ParquetFile(f).read(columns=["sample_id", "status"])
        except (OSError, pa.ArrowException) as e:
            dest = parts_dir / DAMAGED_DIR / f.name
            dest.parent.mkdir(exist_ok=True)
            os.replace(f, dest)
            logger.warning("generate: %s does not read (%s); moved to %s, its prompts are "
                           "generated again", f, str(e).splitlines()[0][:120], dest)
            continue
        good.append((f, ids))
    return good


def _read_part(path: Path) -> pa.Table:
    return pq.read_table(path, schema=CONVERSATIONS_SCHEMA).replace_schema_metadata(None)


COMPACT_GROUP = 256  # generation parts merged per compact file (~4K rows at batch_size 16)


def compact_parts(parts_dir: Path, *, blocking: bool = True) -> int:
    """Merge committed generation parts, COMPACT_GROUP at a time, into compact files (the
    store index's protocol, store/compact.py: a kill -9 at any point loses or doubles no
    row); fewer than 64 parts are left as they are. Compact files are never merged again,
    so no compaction holds more than COMPACT_GROUP parts' rows. Blocking: until done;
    otherwise one merge at most, skipped while another runs. Returns the parts merged."""
    from eagle_ray.store.compact import COMPACT_EVERY_PARTS, compact_dir

    merged = 0
    while True:
        r = compact_dir(parts_dir, _read_part, CONVERSATIONS_SCHEMA, what="generation part",
                        blocking=blocking, min_parts=COMPACT_EVERY_PARTS, merge_compacts=False,
                        max_inputs=COMPACT_GROUP, row_group_size=CONSOLIDATE_CHUNK)
        if not r:
            return merged
        merged += r["merged"]
        if not blocking:
            return merged


def done_prompts(parts_dir: Path, parts: list[tuple[Path, pa.Table]] | None = None) -> pa.Array:
    """Ids of the PROMPTS done in parts_dir (Arrow, unique; from `parts`, `read_parts`' result,
    when the caller has it): all completions of a prompt are written in one part (one
    batch), so a prompt is done when any of its rows is there."""
    from eagle_ray.generate.prompts import prompt_ids, unique_ids

    parts = read_parts(parts_dir) if parts is None else parts
    ids = pa.chunked_array([c for _, t in parts for c in t.column("sample_id").chunks], pa.string())
    return unique_ids(prompt_ids(ids))


def check_generation_params(out: Path, params: dict) -> None:
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
    from eagle_ray.generate.prompts import count_not_in, num_rows, prompt_ids

    t0 = time.time()
    out = Path(out_dir)
    parts_dir = out / PARTS_DIR
    file = prompts_file(prompts)
    check_prompts_render(recipe, file)
    total = num_rows(file, limit)
    model_dir = resolve_target_path(recipe.target)
    claim_output_dir(out, "generate")  # new, empty or an earlier generate output; else refused
    parts_dir.mkdir(parents=True, exist_ok=True)
    params = generation_params(recipe, model_dir)
    check_generation_params(out, params)

    compact_parts(parts_dir)  # what earlier runs left as parts
    done = done_prompts(parts_dir)
    n_todo = count_not_in(file, done, limit)
    skipped = total - n_todo
    logger.info("generate: %d prompts, %d already done in %s, %d to go (mode %s)",
                total, skipped, out, n_todo, recipe.generate.mode)

    n_ok = n_rej = n_tok = 0
    if n_todo:
        from eagle_ray.ops.cluster import init_ray
        from eagle_ray.store.compact import COMPACT_EVERY_PARTS

        init_ray()
        from eagle_ray.ops.control import start_control

        start_control()  # `eagle-ray scale` resizes this run's pools while it runs
        ds = generation_dataset(recipe, prompt_rows(recipe, file, done, limit), model_dir)
        del done
        from eagle_ray.common.progress import Progress

        prog = Progress("generate", total, unit="prompts", start=skipped,
                        interval_s=recipe.generate.progress_interval_s, logger=logger)
        n_parts = 0
        for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            if batch.num_rows == 0:
                continue
            batch = batch.cast(CONVERSATIONS_SCHEMA)
            atomic_write_parquet(parts_dir / f"part-{time.time_ns()}-{uuid.uuid4().hex[:8]}.parquet", batch)
            n_parts += 1
            if n_parts % COMPACT_EVERY_PARTS == 0:
                compact_parts(parts_dir, blocking=False)
            ok = pc.equal(batch.column("status"), "ok")
            n_ok += pc.sum(ok).as_py() or 0
            n_rej += batch.num_rows - (pc.sum(ok).as_py() or 0)
            tok = pc.sum(batch.column("num_completion_tokens")).as_py() or 0
            n_tok += tok
            # prompts done: a batch holds every sample of its prompts (N each, or N a turn)
            prog.update(len(pc.unique(prompt_ids(batch.column("sample_id")))), tokens=tok,
                        extra=f"{n_rej:,} rejected")
        prog.close()
    logger.info("generate: this run generated %d, rejected %d, %d completion tokens in %.1fs",
                n_ok, n_rej, n_tok, time.time() - t0)
    counts = consolidate(out, file, params, limit)
    return GenerateResult(out_dir=out, prompts=total, generated=counts["ok"],
                          rejected=counts["rejected"], skipped_done=skipped,
                          completion_tokens=n_tok, seconds=time.time() - t0)


CONSOLIDATE_CHUNK = 4096  # rows gathered (and written as one row group) at a time


def _gather(files: list[Path], fidx, rows, columns: list[str]):
    """Rows (file `fidx[i]`, row `rows[i]`) from the part files, in that order, a chunk at a
    time (an LRU of a few part files: parts hold neighbouring prompts, so each is read ~once)."""
    from collections import OrderedDict

    import numpy as np

    cache: OrderedDict[int, pa.Table] = OrderedDict()
    for lo in range(0, len(fidx), CONSOLIDATE_CHUNK):
        f, r = fidx[lo:lo + CONSOLIDATE_CHUNK], rows[lo:lo + CONSOLIDATE_CHUNK]
        by_file = np.argsort(f, kind="stable")
        cuts = np.flatnonzero(np.diff(f[by_file])) + 1
        pieces = []
        for grp in np.split(by_file, cuts):
            fi = int(f[grp[0]])
            t = cache.get(fi)
            if t is None:
                t = cache[fi] = _read_part(files[fi]).select(columns)
                if len(cache) > 8:
                    cache.popitem(last=False)
            else:
                cache.move_to_end(fi)
            pieces.append(t.take(pa.array(r[grp])))
        whole = pa.concat_tables(pieces) if pieces else pa.schema(
            [CONVERSATIONS_SCHEMA.field(n) for n in columns]).empty_table()
        yield whole.take(pa.array(np.argsort(by_file, kind="stable")))


def _ranks_by_search(ids: pa.Array, prompts: Path, limit: int | None):
    """Each part row's prompt position, for one completion per prompt and ids of one width
    (ingest's): the part ids sorted once (numpy), the prompt ids streamed a row group at a
    time and searched in them; no hash table and no whole prompt-id column in memory.
    Returns (positions, number of prompts, whether any id repeats), or None where the ids
    are not of one width (the caller's general path)."""
    import numpy as np

    from eagle_ray.generate.prompts import fixed_width, iter_id_chunks, search_sorted

    keys = fixed_width(ids)
    if keys is None:
        return None
    srt = np.argsort(keys, kind="stable")
    sorted_keys = keys[srt]
    repeats = bool(len(sorted_keys) > 1 and np.any(sorted_keys[1:] == sorted_keys[:-1]))
    pos = np.full(len(keys), -1, np.int64)
    base = 0
    for chunk in iter_id_chunks(prompts, limit):
        c = fixed_width(chunk)
        if c is None or c.dtype != keys.dtype:
            return None  # prompt ids of other widths: the general path
        at, found = search_sorted(sorted_keys, c)
        hit = np.flatnonzero(found)
        target = srt[at[hit]]
        first = pos[target] < 0  # a prompt listed twice: its first place, as index_in gives
        target, hit = target[first], hit[first]
        target, keep = np.unique(target, return_index=True)
        pos[target] = base + hit[keep]
        base += len(chunk)
    return pos, base, repeats


def _ranks_by_lookup(ids: pa.Array, prompts: Path, limit: int | None):
    """The general path (any ids, any number of samples per prompt): Arrow's index_in of
    each id's prompt over the whole prompt-id column. Returns (positions, number of
    prompts, repeats)."""
    from eagle_ray.generate.prompts import iter_id_chunks, prompt_ids

    repeats = len(ids) - (pc.count_distinct(ids).as_py() if len(ids) else 0) > 0
    order = pa.chunked_array(list(iter_id_chunks(prompts, limit)), pa.string()).combine_chunks()
    pos = pc.index_in(prompt_ids(ids), value_set=order)
    return pos.fill_null(-1).to_numpy(zero_copy_only=False).astype("int64"), len(order), repeats


def consolidate(out: Path, prompts: Path, params: dict, limit: int | None = None) -> dict[str, int]:
    """Parts -> conversations.parquet (prompt order, then completion index), rejects.jsonl,
    manifest.json; atomic. Memory is bounded by the id column and one chunk of rows: the
    order is computed on the sample ids (numpy, see _ranks_by_search), the rows are gathered
    from the parts chunk by chunk."""
    import numpy as np

    from eagle_ray.generate.prompts import completion_indices

    read = read_parts(out / PARTS_DIR)
    parts = [f for f, _ in read]
    n_rows = [t.num_rows for _, t in read]
    fidx = np.repeat(np.arange(len(read), dtype=np.int32), n_rows)
    rowidx = np.concatenate([np.arange(k, dtype=np.int64) for k in n_rows]) if read else \
        np.zeros(0, np.int64)
    ids = pa.chunked_array([c for _, t in read for c in t.column("sample_id").chunks],
                           pa.string()).combine_chunks()
    is_ok = np.concatenate([pc.equal(t.column("status"), "ok").to_numpy().astype(bool)
                            for _, t in read]) if read else np.zeros(0, bool)
    del read
    n = params["sampling"]["samples_per_prompt"] if params.get("sampling") else 1
    # One sample per prompt, or several (N completions; with data.train_turns=all, N for
    # each turn of the session: as many as its log has)
    single = n == 1 and params.get("train_turns") != "all"
    found = _ranks_by_search(ids, prompts, limit) if single else None
    pos, n_prompts, repeats = found or _ranks_by_lookup(ids, prompts, limit)
    if repeats:  # cannot happen by construction; never ship duplicates
        n_dup = len(ids) - pc.count_distinct(ids).as_py()
        raise AssertionError(f"{n_dup} duplicate sample ids across parts in {out}")
    missing = np.flatnonzero(pos < 0)
    if len(missing):
        raise ValueError(f"{out} holds {len(missing)} samples that are not in these prompts "
                         f"(e.g. {ids[int(missing[0])].as_py()}); it belongs to another prompt set")
    # prompt order, then the number after "#" (ids "<prompt>#<j>", "<prompt>#<t * N + j>")
    if single:
        rank, done_prompts = pos, len(pos)
    else:
        k = completion_indices(ids).to_numpy()
        rank = pos * (int(k.max()) + 1 if len(k) else 1) + k
        done_prompts = len(np.unique(pos))
    del ids, pos
    order = np.argsort(rank, kind="stable")
    del rank
    ok_order, rej_order = order[is_ok[order]], order[~is_ok[order]]
    del order

    tokens, reasons = 0, {}
    with AtomicFile(out / CONVERSATIONS_FILE) as f:
        with pq.ParquetWriter(f.f, CONVERSATIONS_SCHEMA, compression="zstd") as w:
            if not len(ok_order):
                w.write_table(CONVERSATIONS_SCHEMA.empty_table())
            for chunk in _gather(parts, fidx[ok_order], rowidx[ok_order], CONVERSATIONS_SCHEMA.names):
                w.write_table(chunk, row_group_size=CONSOLIDATE_CHUNK)
                tokens += int(pc.sum(chunk.column("num_completion_tokens")).as_py() or 0)
                for r in pc.value_counts(chunk.column("finish_reason")).to_pylist():
                    reasons[r["values"]] = reasons.get(r["values"], 0) + r["counts"]
    lines = []
    for chunk in _gather(parts, fidx[rej_order], rowidx[rej_order], ["sample_id", "source", "reason", "message"]):
        lines += [json.dumps({"sample_id": r["sample_id"], "source": r["source"],
                              "reason": r["reason"], "message": r["message"]}, ensure_ascii=False)
                  for r in chunk.to_pylist()]
    atomic_write_bytes(out / REJECTS_FILE, "".join(l + "\n" for l in lines).encode())
    # pending: samples still to draw (with every turn regenerated a prompt's count is its
    # turns', known once drawn: then prompts still to run, `pending_prompts`)
    counts = {"prompts": n_prompts, "samples_per_prompt": n, "ok": len(ok_order),
              "rejected": len(rej_order), "pending_prompts": n_prompts - done_prompts,
              "pending": (n_prompts - done_prompts) * n if params.get("train_turns") != "all" else None}
    import vllm  # version of the engine that produced the outputs

    manifest = {"schema_version": SCHEMA_VERSION, "stage": "generate", **params,
                "vllm_version": vllm.__version__, "counts": counts,
                "completion_tokens": tokens, "finish_reasons": reasons,
                "provenance": provenance()}
    atomic_write_json(out / MANIFEST_FILE, manifest)
    return counts
