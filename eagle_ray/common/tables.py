"""Reading one stage's output table as the next stage's input, with clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq


def read_stage_table(path: str | Path, file_name: str, required: Sequence[str],
                     producer: str, columns: Sequence[str] | None = None) -> tuple[Path, pa.Table]:
    """(file, table) for a stage directory or the parquet file itself; names the command that
    writes it when missing, and the missing columns when it is some other table."""
    p = Path(path)
    file = p / file_name if p.is_dir() else p
    if not file.exists():
        raise FileNotFoundError(f"{file} does not exist; run `eagle-ray {producer}` first")
    table = pq.read_table(file, columns=list(columns) if columns else None)
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise ValueError(f"{file} lacks column(s) {', '.join(missing)}; is it a {producer} output?")
    return file, table


def stage_file(path: str | Path, file_name: str, required: Sequence[str], producer: str) -> Path:
    """`read_stage_table`'s checks from the Parquet schema alone (no row is read): for inputs
    that are streamed (generation's prompts) rather than loaded."""
    p = Path(path)
    file = p / file_name if p.is_dir() else p
    if not file.exists():
        raise FileNotFoundError(f"{file} does not exist; run `eagle-ray {producer}` first")
    names = pq.read_schema(file).names
    missing = [c for c in required if c not in names]
    if missing:
        raise ValueError(f"{file} lacks column(s) {', '.join(missing)}; is it a {producer} output?")
    return file
