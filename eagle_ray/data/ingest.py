"""Conversation-log ingestion: JSONL chat logs -> deduplicated, mixed ``prompts.parquet``.

Accepted line formats are described in formats.py (OpenAI messages, ShareGPT, plain
prompt/response); line-level checks and reject reason codes in validate.py; source
specs (PATH, PATH:COUNT, PATH:FRACTION) and the seeded mix in mix.py. This module reads
the sources, dedupes, applies the mix and writes the outputs.

Every line read ends up in exactly one bucket -- accepted, duplicate, rejected or
sampled out -- and each bucket except "accepted" has its own JSONL file, so nothing
disappears silently. ``ingest`` checks ``accepted + duplicates + rejected +
sampled_out == lines_read`` overall and per source before it writes anything.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_ray.common.atomic import AtomicFile, fsync_dir
from eagle_ray.common.logs import display_path
from eagle_ray.data.formats import (Reject, canon_encode, canonical_json, loads_line, parse_record,
                                    tools_json, type_name)
from eagle_ray.data.mix import SourceSpec, check_sources, source_selection, shuffle_mix
from eagle_ray.data.validate import (
    UTF8_BOM,
    COUNTERS,
    INVARIANT,
    check_invariant,
    json_error,
    strip_eol,
)

logger = logging.getLogger(__name__)

__all__ = [
    "SourceSpec",
    "IngestResult",
    "ingest",
    "canonical_json",
    "PROMPTS_SCHEMA",
    "PROMPTS_FILE",
    "REJECTS_FILE",
    "DUPLICATES_FILE",
    "SAMPLED_OUT_FILE",
    "REPORT_FILE",
    "summary_line",
    "problems",
]


PROMPTS_FILE = "prompts.parquet"
REJECTS_FILE = "rejects.jsonl"
DUPLICATES_FILE = "duplicates.jsonl"
SAMPLED_OUT_FILE = "sampled_out.jsonl"
REPORT_FILE = "report.json"

PROMPTS_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("source_line", pa.int64(), nullable=False),
        pa.field("messages", pa.string(), nullable=False),
        pa.field("reference", pa.string(), nullable=True),
        pa.field("num_turns", pa.int32(), nullable=False),
        pa.field("content_hash", pa.string(), nullable=False),
        # JSON list of the request's function specs (key order as logged), null: no tools.
        pa.field("tools", pa.string(), nullable=True),
    ]
)

# Module-level so tests can shrink them; not part of the stable API.
PROGRESS_EVERY = 100_000
RAW_MAX_BYTES = 64 << 10
_SKIP_CHUNK = 1 << 20


@dataclass(kw_only=True)
class IngestResult:
    """Counters of one ingest run; the same numbers are in ``report.json``."""

    out_dir: Path
    lines_read: int
    accepted: int
    duplicates: int
    rejected: int
    sampled_out: int
    per_source: dict[str, dict[str, int]]
    reject_reasons: dict[str, int]
    # source label -> reject reason -> count (image parts show here as non_text_part).
    reject_reasons_per_source: dict[str, dict[str, int]] = field(default_factory=dict)
    # source label -> accepted samples whose request carried tools (agent sessions).
    with_tools: dict[str, int] = field(default_factory=dict)
    # source label -> how many samples a count asked for but the source did not have.
    shortfall: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def prompts_path(self) -> Path:
        return self.out_dir / PROMPTS_FILE

    @property
    def report_path(self) -> Path:
        return self.out_dir / REPORT_FILE

    @property
    def invariant_holds(self) -> bool:
        def ok(c: dict[str, int]) -> bool:
            return c["accepted"] + c["duplicates"] + c["rejected"] + c["sampled_out"] == c["lines_read"]

        return ok(self.counters()) and all(ok(c) for c in self.per_source.values())

    def counters(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in COUNTERS}


def is_json_array(path: str | Path) -> bool:
    """Is the source one JSON array (its first byte past a BOM and whitespace is '[')? Else
    JSONL: a record per line."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    head = head[3:] if head.startswith(UTF8_BOM) else head
    return head.lstrip()[:1] == b"["


def summary_line(counts: dict) -> str:
    """Ingest's one line (the `eagle-ray ingest` command and the job print it)."""
    return (f"ingest: accepted {counts['accepted']:,} + duplicates {counts['duplicates']:,} + "
            f"rejected {counts['rejected']:,} + sampled out {counts['sampled_out']:,} = lines read "
            f"{counts['lines_read']:,}")


def problems(counts: dict, out_dir: str | Path) -> list[str]:
    """What makes an ingest unusable (the command exits 1, the job stops)."""
    return ([f"no sample was accepted; see {Path(out_dir) / REJECTS_FILE}"]
            if counts["accepted"] == 0 else [])


# --------------------------------------------------------------------------- output files


class _RowsFile(AtomicFile):
    """An atomic JSON-lines output (rejects, duplicates, sampled-out) that counts its rows."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.rows = 0

    def write_row(self, row: dict) -> None:
        self.f.write(json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")
        self.rows += 1


@contextlib.contextmanager
def _no_cyclic_gc():
    """The cyclic garbage collector off while lines are read: every parsed line is a few
    dicts and lists, each allocation counts toward a collection that walks every container
    of the process (imports included), and a line's objects hold no cycle (refcounting
    frees them). 42K -> 66K lines/s on the 200K-line bench. Restored on the way out."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# --------------------------------------------------------------------------- ingest


class _Ingestor:
    def __init__(self, sources, out_dir, seed, max_line_bytes, progress):
        self.sources: list[SourceSpec] = sources
        self.out_dir: Path = out_dir
        self.seed = seed
        self.max_line_bytes = max_line_bytes
        self.progress = progress
        self.warnings: list[str] = []
        self.reject_reasons: dict[str, int] = {}
        self.source_reasons: dict[str, dict[str, int]] = {s.name: {} for s in sources}
        self.per_source = {s.name: dict.fromkeys(COUNTERS, 0) for s in sources}
        self.formats = {s.name: {"openai": 0, "sharegpt": 0, "plain": 0} for s in sources}
        self.file_info: list[dict[str, Any]] = []
        # Accepted (deduplicated) samples, as parallel lists; the Arrow table is built once at the end.
        self.a_src: list[int] = []
        self.a_line: list[int] = []
        self.a_msgs: list[bytes] = []  # canonical JSON, UTF-8
        self.a_ref: list[bytes | None] = []
        self.a_turns: list[int] = []
        self.a_hash: list[str] = []
        self.a_tools: list[str | None] = []
        self.seen: dict[str, int] = {}  # content_hash -> index in the a_* lists
        self.ranges: list[tuple[int, int]] = []
        self.lines_total = 0
        self.t0 = time.monotonic()

    def say(self, msg: str, warn: bool = False) -> None:
        if warn:
            self.warnings.append(msg)
            logger.warning("%s", msg)
        else:
            logger.info("%s", msg)
        if self.progress is not None:
            self.progress(("warning: " if warn else "") + msg)

    def _reject(self, rejects: _RowsFile, source: str, counts: dict, lineno: int, offset: int,
                code: str, message: str, raw: bytes, raw_len: int) -> None:
        counts["rejected"] += 1
        self.reject_reasons[code] = self.reject_reasons.get(code, 0) + 1
        by_source = self.source_reasons.setdefault(source, {})
        by_source[code] = by_source.get(code, 0) + 1
        rejects.write_row(
            {
                "source": source,
                "line": lineno,
                "byte_offset": offset,
                "reason": code,
                "message": message,
                "raw": raw[:RAW_MAX_BYTES].decode("utf-8", errors="replace"),
                "raw_bytes": raw_len,
                "raw_truncated": raw_len > RAW_MAX_BYTES,
            }
        )

    def _take(self, obj: Any, chunk: bytes, si: int, name: str, counts: dict, fmts: dict, lineno: int,
              line_start: int, rejects: _RowsFile, dups: _RowsFile) -> None:
        """One parsed record of source `si`: validated and canonicalized, then kept, counted
        as a duplicate of the first copy, or rejected with its reason (`chunk`: its bytes)."""
        try:
            prompt, ref, fmt, tools = parse_record(obj)
            # UTF-8 bytes from here on: hashed as they are, and Arrow takes them
            # without encoding each string again (or caching a copy in it).
            m = canon_encode(prompt).encode("utf-8")
            r = None if ref is None else canon_encode(ref).encode("utf-8")
            t = None if tools is None else b',"tools":' + canon_encode(tools).encode("utf-8")
            # Equal to canonical_json(prompt, ref, tools): sort_keys puts "messages" first.
            h = hashlib.sha256(b'{"messages":' + m + b',"reference":' + (r or b"null") + (t or b"")
                               + b"}").hexdigest()
            tj = tools_json(tools)
        except Reject as e:
            raw = strip_eol(chunk)
            self._reject(rejects, name, counts, lineno, line_start, e.code, e.message, raw, len(raw))
            return
        except UnicodeEncodeError:
            # A "\ud800"-style escape decodes to a lone surrogate, which is not valid
            # text and cannot be written to Parquet.
            raw = strip_eol(chunk)
            self._reject(rejects, name, counts, lineno, line_start, "invalid_unicode",
                         "a string contains a lone UTF-16 surrogate (\\ud800-\\udfff escape)",
                         raw, len(raw))
            return
        fmts[fmt] += 1
        kept = self.seen.get(h)
        if kept is not None:
            counts["duplicates"] += 1
            dups.write_row({"source": name, "line": lineno, "sample_id": "s" + h[:20],
                            "kept_source": self.sources[self.a_src[kept]].name,
                            "kept_line": self.a_line[kept]})
            return
        self.seen[h] = len(self.a_hash)
        self.a_src.append(si)
        self.a_line.append(lineno)
        self.a_msgs.append(m)
        self.a_ref.append(r)
        self.a_turns.append(len(prompt))
        self.a_hash.append(h)
        self.a_tools.append(tj)

    def read_source(self, si: int, size: int, rejects: _RowsFile, dups: _RowsFile) -> None:
        """One source, JSONL (a record per line) or one JSON array (ShareGPT's usual form):
        every record ends kept, a duplicate or a reject; the file's size and sha256 recorded."""
        spec = self.sources[si]
        path, name = spec.path, spec.name  # the file, its label (rows)
        shown = display_path(path)  # the user's path (messages), not a Ray job's copy
        counts = self.per_source[name]
        start_idx = len(self.a_hash)
        hasher = hashlib.sha256()
        if size == 0:
            self.say(f"source {shown} is empty (0 bytes)", warn=True)
        read = self._read_array if is_json_array(path) else self._read_lines
        lineno, offset = read(si, shown, hasher.update, rejects, dups)
        counts["lines_read"] = lineno
        self.ranges.append((start_idx, len(self.a_hash)))
        if offset != size:
            self.say(f"source {shown} changed while being read ({size} bytes at start, {offset} read)",
                      warn=True)
        self.file_info.append({"size_bytes": offset, "sha256": hasher.hexdigest()})
        n_ok = len(self.a_hash) - start_idx
        if lineno and n_ok == 0 and counts["duplicates"] == 0:
            self.say(f"source {shown}: none of its {lineno} lines was accepted; see {REJECTS_FILE}",
                      warn=True)
        self.say(
            f"{shown}: {lineno} lines, {n_ok} new samples, {counts['duplicates']} duplicates, "
            f"{counts['rejected']} rejected"
        )

    def _tick(self, shown: str, what: str, n: int) -> None:
        self.lines_total += 1
        if self.lines_total % PROGRESS_EVERY == 0:
            dt = max(time.monotonic() - self.t0, 1e-9)
            self.say(f"{self.lines_total:,} lines read ({self.lines_total / dt:,.0f} lines/s), "
                     f"now {shown} {what} {n:,}")

    def _read_lines(self, si: int, shown: str, update, rejects: _RowsFile, dups: _RowsFile) -> tuple[int, int]:
        """JSONL: a record per line. Returns (lines, bytes read)."""
        name = self.sources[si].name
        counts, fmts = self.per_source[name], self.formats[name]
        limit = self.max_line_bytes + 1
        loads = loads_line
        lineno = offset = 0
        with open(self.sources[si].path, "rb", buffering=1 << 20) as f:
            readline = f.readline
            while True:
                chunk = readline(limit)
                if not chunk:
                    break
                lineno += 1
                line_start = offset
                offset += len(chunk)
                update(chunk)
                self._tick(shown, "line", lineno)
                if len(chunk) == limit and chunk[-1] != 10:
                    # Either over the limit, or exactly at it with a "\r\n" split by the limit.
                    if chunk[-1] == 13 and f.peek(1)[:1] == b"\n":
                        nl = f.read(1)
                        update(nl)
                        offset += 1
                        chunk += nl
                    else:
                        offset = self._skip_long_line(
                            f, chunk, update, offset, rejects, name, counts, lineno, line_start
                        )
                        del chunk  # drop the ~max_line_bytes buffer before the next read
                        continue
                if line_start == 0 and chunk.startswith(UTF8_BOM):
                    chunk = chunk[3:]
                # json.loads accepts the trailing "\r\n" as whitespace, so the line is not
                # sliced (copied) on the hot path; only rejects strip it.
                if chunk.isspace() or not chunk:
                    raw = chunk.rstrip(b"\n").rstrip(b"\r")
                    self._reject(rejects, name, counts, lineno, line_start, "blank_line",
                                 "line is empty or whitespace only", raw, len(raw))
                    continue
                try:
                    text = chunk.decode("utf-8")
                except UnicodeDecodeError as e:
                    raw = strip_eol(chunk)
                    self._reject(rejects, name, counts, lineno, line_start, "invalid_utf8",
                                 f"invalid UTF-8 at byte {e.start} of the line ({e.reason})",
                                 raw, len(raw))
                    continue
                try:
                    obj = loads(text)
                except (ValueError, RecursionError) as e:
                    raw = strip_eol(chunk)
                    msg = json_error(text, e)
                    self._reject(rejects, name, counts, lineno, line_start, "invalid_json",
                                 f"invalid JSON: {msg}", raw, len(raw))
                    continue
                self._take(obj, chunk, si, name, counts, fmts, lineno, line_start, rejects, dups)
        return lineno, offset

    def _read_array(self, si: int, shown: str, update, rejects: _RowsFile, dups: _RowsFile) -> tuple[int, int]:
        """One JSON array of records, streamed (data/json_array.py): each record counts as a
        line (its number in the array) with its byte offset; a damaged or cut-off tail
        (ShareGPT V3's file ends mid-record) is one reject row naming the byte where it
        starts, and every complete record before it is kept. Returns (records + tail, bytes)."""
        from eagle_ray.data.json_array import ArrayReader, Record

        name = self.sources[si].name
        counts, fmts = self.per_source[name], self.formats[name]
        n = 0
        with open(self.sources[si].path, "rb", buffering=1 << 20) as f:
            reader = ArrayReader(f, update, self.max_line_bytes)
            for item in reader:
                n += 1
                self._tick(shown, "record", n)
                if isinstance(item, Record):
                    self._take(item.obj, item.raw, si, name, counts, fmts, n, item.offset, rejects, dups)
                else:
                    self._reject(rejects, name, counts, n, item.offset, item.code, item.message,
                                 item.head, item.size)
        return n, reader.size

    def _skip_long_line(self, f, chunk, update, offset, rejects, name, counts, lineno, line_start):
        """Consume the rest of an over-long line in bounded chunks and record one reject."""
        head = chunk[:RAW_MAX_BYTES]
        total = len(chunk)
        tail = chunk[-2:]
        readline = f.readline
        ended = False
        while True:
            c = readline(_SKIP_CHUNK)
            if not c:
                break
            update(c)
            total += len(c)
            offset += len(c)
            tail = (tail + c[-2:])[-2:]
            if c[-1] == 10:
                ended = True
                break
        raw_len = total - (2 if ended and tail == b"\r\n" else 1 if ended else 0)
        self._reject(rejects, name, counts, lineno, line_start, "line_too_long",
                     f"line is {raw_len:,} bytes, over the max_line_bytes limit of "
                     f"{self.max_line_bytes:,}", head, raw_len)
        return offset

    def select(self, sampled: _RowsFile) -> tuple[list[int], dict[str, int], list[dict[str, Any]]]:
        """Apply per-source count/fraction; return kept indices (shuffled), shortfalls, selection info."""
        keep: list[int] = []
        shortfall: dict[str, int] = {}
        info = []
        for si, spec in enumerate(self.sources):
            lo, hi = self.ranges[si]
            n = hi - lo
            if spec.count is not None and spec.count > n:
                shortfall[spec.name] = spec.count - n
                self.say(
                    f"source {spec.path}: asked for {spec.count} samples but only {n} were "
                    f"accepted after dedupe; taking all {n} (short by {spec.count - n})",
                    warn=True,
                )
            k, chosen, derived = source_selection(spec, n, self.seed)
            if chosen is not None:
                chosen_set = set(chosen)
                keep.extend(lo + j for j in chosen)
                for j in range(n):
                    if j not in chosen_set:
                        i = lo + j
                        sampled.write_row(
                            {"source": spec.name, "line": self.a_line[i], "sample_id": "s" + self.a_hash[i][:20]}
                        )
                self.per_source[spec.name]["sampled_out"] = n - k
            else:
                keep.extend(range(lo, hi))
            self.per_source[spec.name]["accepted"] = k
            info.append({"available": n, "selected": k, "shortfall": shortfall.get(spec.name, 0),
                         "derived_seed": derived})
        shuffle_mix(keep, self.seed)
        return keep, shortfall, info

    def build_table(self, keep: list[int]) -> pa.Table:
        """The kept samples in `keep`'s order, gathered by Arrow (no Python object per row)."""
        import pyarrow.compute as pc

        sel = pa.array(keep, pa.int64())
        hashes = pa.array(self.a_hash, pa.string()).take(sel)
        labels = pa.array([s.name for s in self.sources], pa.string())  # the source column holds labels
        # pa.array returns a ChunkedArray if a string column outgrows 2 GiB; from_arrays takes both.
        return pa.Table.from_arrays(
            [
                pc.binary_join_element_wise("s", pc.utf8_slice_codeunits(hashes, 0, 20), ""),
                labels.take(pa.array(self.a_src, pa.int32()).take(sel)),
                pa.array(self.a_line, pa.int64()).take(sel),
                pa.array(self.a_msgs, pa.binary()).cast(pa.string()).take(sel),
                pa.array(self.a_ref, pa.binary()).cast(pa.string()).take(sel),
                pa.array(self.a_turns, pa.int32()).take(sel),
                hashes,
                pa.array(self.a_tools, pa.string()).take(sel),
            ],
            schema=PROMPTS_SCHEMA,
        )


def _check_args(seed: int, max_line_bytes: int) -> None:
    """Raise ValueError for a max_line_bytes or seed that is not a valid integer."""
    if isinstance(max_line_bytes, bool) or not isinstance(max_line_bytes, int) or max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be a positive integer, got {max_line_bytes!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")


def _open_rows_files(out: Path, files: list[AtomicFile]) -> tuple[_RowsFile, _RowsFile, _RowsFile]:
    """Open the rejects, duplicates and sampled-out outputs, each added to `files` as it opens."""
    rejects = _RowsFile(out / REJECTS_FILE)
    files.append(rejects)
    dups = _RowsFile(out / DUPLICATES_FILE)
    files.append(dups)
    sampled = _RowsFile(out / SAMPLED_OUT_FILE)
    files.append(sampled)
    return rejects, dups, sampled


def _annotated(table: pa.Table, annotate: Callable[[pa.Table], pa.Table]) -> pa.Table:
    """Apply `annotate` to the table and check that it kept every row and column."""
    n_rows = table.num_rows
    table = annotate(table)
    if not isinstance(table, pa.Table):
        raise TypeError(f"annotate must return a pyarrow.Table, got {type_name(table)}")
    missing = [c for c in PROMPTS_SCHEMA.names if c not in table.column_names]
    if table.num_rows != n_rows or missing:
        raise ValueError(
            f"annotate must keep all rows and columns (rows {n_rows} -> {table.num_rows}, "
            f"missing columns {missing})"
        )
    return table


def _checked_totals(ing: _Ingestor, table: pa.Table, rejects: _RowsFile, dups: _RowsFile,
                    sampled: _RowsFile) -> dict[str, int]:
    """Sum the per-source counters and check the invariant and the output row counts."""
    totals = dict.fromkeys(COUNTERS, 0)
    for c in ing.per_source.values():
        for k in COUNTERS:
            totals[k] += c[k]
    for path, c in ing.per_source.items():
        check_invariant(f"source {path}", c)
    check_invariant("total", totals)
    if totals["accepted"] != table.num_rows or totals["rejected"] != rejects.rows \
            or totals["duplicates"] != dups.rows or totals["sampled_out"] != sampled.rows:
        raise AssertionError("output row counts do not match the counters")
    return totals


def _write_prompts(out: Path, table: pa.Table, files: list[AtomicFile]) -> None:
    """Write the table to a new atomic ``prompts.parquet``, added to `files`."""
    pq_file = AtomicFile(out / PROMPTS_FILE)
    files.append(pq_file)
    pq.write_table(table, pq_file.f, compression="zstd", row_group_size=100_000)


def _report(ing: _Ingestor, totals: dict[str, int], reject_reasons: dict[str, int],
            sel_info: list[dict[str, Any]], shortfall: dict[str, int]) -> dict[str, Any]:
    """The contents of ``report.json``."""
    return {
        "version": 1,
        **totals,
        "invariant": {"formula": INVARIANT, "holds": True},
        "per_source": ing.per_source,
        "reject_reasons": reject_reasons,
        "seed": ing.seed,
        "max_line_bytes": ing.max_line_bytes,
        "sources": [
            {
                "label": s.name,
                "path": display_path(s.path),
                "count": s.count,
                "fraction": s.fraction,
                **ing.file_info[i],
                **sel_info[i],
                "formats": ing.formats[s.name],
            }
            for i, s in enumerate(ing.sources)
        ],
        "shortfall": shortfall,
        "warnings": ing.warnings,
        "outputs": [PROMPTS_FILE, REJECTS_FILE, DUPLICATES_FILE, SAMPLED_OUT_FILE, REPORT_FILE],
    }


def _with_tools(table: pa.Table, labels: list[str]) -> dict[str, int]:
    """Accepted samples per source whose request carried tools (agent sessions)."""
    import pyarrow.compute as pc

    has = table.filter(pc.is_valid(table.column("tools"))).column("source").to_pylist()
    return {label: has.count(label) for label in labels}


def _write_report(out: Path, report: dict[str, Any], files: list[AtomicFile]) -> None:
    """Write the report to a new atomic ``report.json``, added to `files`."""
    rep = AtomicFile(out / REPORT_FILE)
    files.append(rep)
    rep.f.write(json.dumps(report, indent=2, ensure_ascii=False).encode("utf-8") + b"\n")


def _commit_outputs(out: Path, files: list[AtomicFile]) -> None:
    """Finish and rename all outputs into place, report.json last, then fsync the directory."""
    for af in files:
        af.finish()
    # An old report next to half-replaced outputs would be misleading; report.json
    # is removed first and renamed in last, so its presence marks a complete set.
    (out / REPORT_FILE).unlink(missing_ok=True)
    for af in files:
        af.commit(sync_dir=False)  # one fsync of the directory for all of them, below
    fsync_dir(out)


def _say_done(ing: _Ingestor, totals: dict[str, int], out: Path) -> None:
    """Report the run's counters and its rate."""
    dt = time.monotonic() - ing.t0
    ing.say(
        f"ingested {totals['lines_read']} lines in {dt:.1f}s "
        f"({totals['lines_read'] / max(dt, 1e-9):,.0f} lines/s): {totals['accepted']} accepted, "
        f"{totals['duplicates']} duplicates, {totals['rejected']} rejected, "
        f"{totals['sampled_out']} sampled out -> {out}"
    )


def _non_text_share(ing: _Ingestor, per_source_reasons: dict[str, dict[str, int]]) -> dict[str, float]:
    """Per source, the share of its records rejected for image (or other non-text) parts,
    said once as a warning: that part of the user's traffic is not trained on, since the
    capture is text only (docs/design.md, "Images (multimodal capture): what it needs")."""
    shares = {}
    for src, reasons in per_source_reasons.items():
        k, n = reasons.get("non_text_part", 0), ing.per_source[src]["lines_read"]
        if k and n:
            shares[src] = k / n
            ing.say(f"{src}: {k:,} of its {n:,} sessions ({k / n:.1%}) carry images or other "
                    "non-text parts, rejected (non_text_part): the capture is text only, so "
                    "that share of the traffic is not trained on", warn=True)
    return shares


def ingest(
    sources: list[SourceSpec],
    out_dir: str | Path,
    *,
    seed: int = 0,
    max_line_bytes: int = 16 << 20,
    annotate: Callable[[pa.Table], pa.Table] | None = None,
    progress: Callable[[str], None] | None = None,
) -> IngestResult:
    """Validate, dedupe and mix JSONL conversation logs into ``out_dir``.

    Writes ``prompts.parquet``, ``rejects.jsonl``, ``duplicates.jsonl``,
    ``sampled_out.jsonl`` and (last) ``report.json``, each atomically. All sources are
    checked before anything is written. ``annotate`` may add columns to the final
    (shuffled) table; it is also called on an empty table so the schema is stable.
    """
    _check_args(seed, max_line_bytes)
    sources = list(sources)
    sizes = check_sources(sources)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    ing = _Ingestor(sources, out, seed, max_line_bytes, progress)
    files: list[AtomicFile] = []
    try:
        rejects, dups, sampled = _open_rows_files(out, files)
        with _no_cyclic_gc():
            for si in range(len(sources)):
                ing.read_source(si, sizes[si], rejects, dups)
        keep, shortfall, sel_info = ing.select(sampled)
        table = ing.build_table(keep)
        ing.a_msgs = ing.a_ref = []  # the table holds its own copy now
        if annotate is not None:
            table = _annotated(table, annotate)

        totals = _checked_totals(ing, table, rejects, dups, sampled)
        if totals["accepted"] == 0:
            ing.say("no sample was accepted; writing empty outputs", warn=True)

        _write_prompts(out, table, files)
        with_tools = _with_tools(table, [s.name for s in sources])
        del table

        reject_reasons = dict(sorted(ing.reject_reasons.items()))
        per_source_reasons = {k: dict(sorted(v.items())) for k, v in ing.source_reasons.items()}
        report = _report(ing, totals, reject_reasons, sel_info, shortfall)
        report["reject_reasons_per_source"] = per_source_reasons
        report["non_text_share"] = _non_text_share(ing, per_source_reasons)
        report["with_tools"] = with_tools
        _write_report(out, report, files)
        _commit_outputs(out, files)
    except BaseException:
        for af in files:
            af.abort()
        raise

    _say_done(ing, totals, out)
    return IngestResult(
        out_dir=out,
        per_source=ing.per_source,
        reject_reasons=reject_reasons,
        reject_reasons_per_source=per_source_reasons,
        with_tools=with_tools,
        shortfall=shortfall,
        warnings=ing.warnings,
        **totals,
    )
