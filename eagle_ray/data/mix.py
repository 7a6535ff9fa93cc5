"""Source specs and mixing: which input files, and how much of each goes into the mix.

A source is ``PATH`` (all samples), ``PATH:COUNT`` or ``PATH:FRACTION``, each optionally
followed by ``::LABEL`` (see ``SourceSpec.parse``). Its label (the file's stem unless given)
names it everywhere downstream: the prompts' ``source`` column, stats, store, reports. Counts and fractions apply to a source's samples accepted after
dedupe. Each source is subsampled with its own seed derived from (seed, path), so adding
or removing a source leaves the selection from the others unchanged; the kept samples of
all sources are then shuffled together with a seed derived from the run's seed.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from eagle_ray.data.formats import type_name

_SPEC_HELP = (
    "use PATH (all samples), PATH:COUNT with an integer COUNT >= 1 (e.g. data.jsonl:1000) "
    "or PATH:FRACTION with 0 < FRACTION <= 1 (e.g. data.jsonl:0.25)"
)
_LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_INT_RE = re.compile(r"[+-]?\d+")
# Deliberately narrower than float(): "inf"/"nan" suffixes stay part of the path.
_FLOAT_RE = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|[+-]?\d+[eE][+-]?\d+")


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True, kw_only=True)
class SourceSpec:
    """One input file plus how much of it goes into the mix (all, a count or a fraction)."""

    path: str
    count: int | None = None
    fraction: float | None = None
    label: str | None = None  # None: the file's stem

    @property
    def name(self) -> str:
        """The short, stable name of this source: its label, else the file's stem."""
        return self.label or Path(self.path).stem

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"source path must be a non-empty string, got {self.path!r}")
        if self.label is not None and not (isinstance(self.label, str) and _LABEL_RE.fullmatch(self.label)):
            raise ValueError(f"source {self.path!r}: label {self.label!r} must be 1-64 characters of "
                             "letters, digits, '_', '.' or '-', starting with a letter or digit")
        if not self.label and not Path(self.path).stem:
            raise ValueError(f"source {self.path!r} has no file stem to label it by; give a "
                             "label: PATH::LABEL")
        if self.count is not None and self.fraction is not None:
            raise ValueError(f"source {self.path!r}: give count or fraction, not both")
        if self.count is not None:
            if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
                raise ValueError(
                    f"source {self.path!r}: count must be an integer >= 1, got {self.count!r}; "
                    + _SPEC_HELP
                )
        if self.fraction is not None:
            f = self.fraction
            if (
                isinstance(f, bool)
                or not isinstance(f, (int, float))
                or not math.isfinite(f)
                or not 0 < f <= 1
            ):
                raise ValueError(
                    f"source {self.path!r}: fraction must be in (0, 1], got {f!r}; "
                    "weights above 1 would duplicate samples, which dedupe would remove; "
                    "use a count instead. " + _SPEC_HELP
                )

    @classmethod
    def parse(cls, text: str) -> "SourceSpec":
        """Parse ``PATH``, ``PATH:COUNT`` or ``PATH:FRACTION``, each optionally ending in
        ``::LABEL`` (e.g. ``mine.jsonl:1000::personal``).

        Only a numeric suffix is a spec, so paths containing ':' still work.
        ``PATH:1`` is a count of one; write ``PATH:1.0`` for "all as a fraction".
        """
        if not isinstance(text, str) or not text:
            raise ValueError(f"empty source spec; {_SPEC_HELP}")
        label = None
        body, sep2, tail2 = text.rpartition("::")
        if sep2 and body:
            if not _LABEL_RE.fullmatch(tail2):
                raise ValueError(f"source spec {text!r}: label {tail2!r} must be 1-64 characters of "
                                 "letters, digits, '_', '.' or '-', starting with a letter or digit")
            text, label = body, tail2
        spec = cls._parse_amount(text)
        return spec if label is None else cls(path=spec.path, count=spec.count,
                                              fraction=spec.fraction, label=label)

    @classmethod
    def _parse_amount(cls, text: str) -> "SourceSpec":
        head, sep, tail = text.rpartition(":")
        if sep and (_INT_RE.fullmatch(tail) or _FLOAT_RE.fullmatch(tail)):
            if not head:
                raise ValueError(f"source spec {text!r} has no path; {_SPEC_HELP}")
            if _INT_RE.fullmatch(tail):
                n = int(tail)
                if n < 1:
                    raise ValueError(
                        f"source spec {text!r}: count must be >= 1, got {n}; {_SPEC_HELP}"
                    )
                return cls(path=head, count=n)
            x = float(tail)
            if not 0 < x <= 1:
                raise ValueError(
                    f"source spec {text!r}: fraction must be in (0, 1], got {tail}; "
                    "weights above 1 would duplicate samples, which dedupe would remove; "
                    f"use a count instead. {_SPEC_HELP}"
                )
            return cls(path=head, fraction=x)
        return cls(path=text)

    def describe(self) -> str:
        lab = f"::{self.label}" if self.label else ""
        if self.count is not None:
            return f"{self.path}:{self.count}{lab}"
        if self.fraction is not None:
            return f"{self.path}:{self.fraction:g}{lab}"
        return self.path + lab


# --------------------------------------------------------------------------- mixing


def _derive_seed(seed: int, *parts: str) -> int:
    h = hashlib.sha256("\0".join([str(seed), *parts]).encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big")


def check_sources(sources: list[SourceSpec]) -> list[int]:
    """Validate all sources up front (so nothing is written on a bad path); return sizes."""
    if not sources:
        raise ValueError("no sources given")
    seen: dict[str, str] = {}
    labels: dict[str, str] = {}
    sizes = []
    for spec in sources:
        if not isinstance(spec, SourceSpec):
            raise TypeError(f"sources must be SourceSpec objects, got {type_name(spec)}")
        p = spec.path
        try:
            st = os.stat(p)
        except FileNotFoundError:
            raise FileNotFoundError(f"source file not found: {p}") from None
        except OSError as e:
            raise ValueError(f"cannot access source {p}: {e.strerror or e}") from e
        if stat.S_ISDIR(st.st_mode):
            raise ValueError(f"source {p} is a directory; give a JSONL file")
        real = os.path.realpath(p)
        if real in seen:
            raise ValueError(
                f"source {p} is given twice (also as {seen[real]}); its samples would all be duplicates"
            )
        seen[real] = p
        if spec.name in labels:
            raise ValueError(f"sources {labels[spec.name]} and {p} would both be labelled "
                             f"{spec.name!r}; give one a label: PATH::LABEL")
        labels[spec.name] = p
        try:
            with open(p, "rb"):
                pass
        except OSError as e:
            raise ValueError(f"cannot read source {p}: {e.strerror or e}") from e
        sizes.append(st.st_size)
    return sizes


def source_selection(spec: SourceSpec, n: int, seed: int) -> tuple[int, list[int] | None, int]:
    """How many of a source's ``n`` accepted samples go into the mix, and which.

    Returns ``(k, chosen, derived_seed)``: ``chosen`` is the sorted positions (0..n-1) of
    the ``k`` kept samples, or None when all ``n`` are kept. A count larger than ``n``
    takes all ``n`` (the caller reports the shortfall).
    """
    if spec.count is not None:
        k = min(spec.count, n)
    elif spec.fraction is not None:
        k = min(n, round(spec.fraction * n))
    else:
        k = n
    derived = _derive_seed(seed, "source", spec.path)
    if k < n:
        # Per-source seed from (seed, path): adding a source leaves this selection alone.
        return k, sorted(random.Random(derived).sample(range(n), k)), derived
    return k, None, derived


def shuffle_mix(keep: list[int], seed: int) -> None:
    """Shuffle the kept samples of all sources together, in place."""
    random.Random(_derive_seed(seed, "mix")).shuffle(keep)
