"""Progress a person can read: done/total, rates and an ETA at a steady interval.

Every long stage (generate, extract, the streamed pair, training, evaluation) reports through
one `Progress`. In logs (`ray job logs`, a file, a pipe) it writes a plain line through the
stage's logger at most every `interval_s`:

    generate: 1,200/10,000 prompts (12%), 3.1 prompts/s, 450 tokens/s, ETA 47m10s

On an interactive terminal it draws a live tqdm bar instead (tqdm already comes with vLLM and
transformers), and still logs a plain line at the end. Rates count this run's work only:
samples an earlier run finished (`start`) are in done/total but not in the rate, so a resumed
run's ETA is not flattered by the work it skipped. Units that end without output (a streamed
run's prompts rejected as too long) are counted by an `ended` callable and said beside done:

    generate+extract: 1,200/2,000 samples, 300 rejected (75%), 1.0 samples/s, ..., ETA 6m40s

so the percentage reaches 100% and the ETA counts only what is still to come.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Callable


def hms(seconds: float) -> str:
    """A duration as a person reads it: 35s, 4m40s, 1h02m."""
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        return "?"
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _si(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div * 10:
            return f"{x / div:,.1f}{suffix}"
    return f"{x:,.1f}" if abs(x) < 100 else f"{x:,.0f}"


def interactive() -> bool:
    """A person at a terminal (and not told otherwise by EAGLE_RAY_PLAIN_PROGRESS=1)."""
    if os.environ.get("EAGLE_RAY_PLAIN_PROGRESS") == "1":
        return False
    from eagle_ray.common import native_stderr

    tty = native_stderr.console_is_tty()  # fd 2 is the filter's pipe, in front of the console
    if tty is not None:
        return tty
    try:  # the real stderr: the CLI wraps sys.stderr to keep tracebacks behind -v
        return sys.__stderr__.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """Progress of one stage. `update(n, tokens=..., bytes=...)` after each piece of work;
    `close()` at the end (logs the final line). `total` counts the whole stage, `start` what
    an earlier run already did."""

    def __init__(self, stage: str, total: int, *, unit: str = "samples", start: int = 0,
                 interval_s: float = 10.0, logger: logging.Logger | None = None,
                 extra: str = "", ended: Callable[[], int] | None = None, ended_as: str = "rejected"):
        self.stage, self.total, self.unit, self.start = stage, int(total), unit, int(start)
        self.done = self.start
        # Units of the total that ended without output, so far (earlier runs' included):
        # polled when a line is drawn, at most once an interval.
        self._ended, self.ended_as = ended, ended_as
        self.ended = self.ended_start = int(ended()) if ended is not None else 0
        self.tokens = 0
        self.bytes = 0
        self.extra = extra
        self.interval_s = interval_s
        self.logger = logger or logging.getLogger(f"eagle_ray.{stage.split()[0]}")
        self.t0 = self._last = time.monotonic()
        self._bar = None
        self._logged = -1
        if interactive():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=self.total, initial=self.start + self.ended, unit=f" {unit}",
                                 desc=stage, dynamic_ncols=True, leave=False, file=sys.__stderr__)
            except ImportError:
                self._bar = None

    def rate(self) -> float:
        """This run's units per second."""
        return (self.done - self.start) / max(1e-9, time.monotonic() - self.t0)

    def _poll_ended(self) -> int:
        """The `ended` count now (new units only: it never goes back)."""
        if self._ended is None:
            return 0
        before, self.ended = self.ended, max(self.ended, int(self._ended()))
        return self.ended - before

    def eta_s(self) -> float:
        # Units that ended without output finish too: the ETA's rate counts both.
        r = (self.done - self.start + self.ended - self.ended_start) / max(1e-9, time.monotonic() - self.t0)
        left = max(0, self.total - self.done - self.ended)
        return 0.0 if left == 0 else (left / r if r > 0 else float("inf"))

    def line(self, extra: str | None = None, *, final: bool = False) -> str:
        elapsed = time.monotonic() - self.t0
        ended = f", {self.ended:,} {self.ended_as}" if self.ended else ""
        pct = f" ({100 * (self.done + self.ended) / self.total:.0f}%)" if self.total else ""
        parts = [f"{self.stage}: {self.done:,}/{self.total:,} {self.unit}{ended}{pct}",
                 f"{_si(self.rate())} {self.unit}/s"]
        if self.tokens:
            parts.append(f"{_si(self.tokens / max(1e-9, elapsed))} tokens/s")
        if self.bytes:
            parts.append(f"{self.bytes / 1e9:,.2f} GB written")
        extra = self.extra if extra is None else extra
        if extra:
            parts.append(extra)
        # The last line never carries an ETA: a stage can end short of its total (prompts
        # rejected as too long yield no sample; the caller's summary counts them).
        parts.append(f"ETA {hms(self.eta_s())}" if self.done + self.ended < self.total and not final
                     else f"done in {hms(elapsed)}")
        return ", ".join(parts)

    def update(self, n: int = 1, *, tokens: int = 0, bytes: int = 0, extra: str | None = None,
               force: bool = False) -> None:
        self.done += int(n)
        self.tokens += int(tokens)
        self.bytes += int(bytes)
        if extra is not None:
            self.extra = extra
        if self._bar is not None:
            self._bar.update(int(n) + self._poll_ended())
            if self.tokens:
                self._bar.set_postfix_str(f"{_si(self.tokens / max(1e-9, time.monotonic() - self.t0))} tok/s",
                                          refresh=False)
            return
        now = time.monotonic()
        if force or now - self._last >= self.interval_s:
            self._last = now
            self._poll_ended()
            self._logged = self.done
            self.logger.info("%s", self.line())

    def close(self) -> None:
        new = self._poll_ended()
        if self._bar is not None:
            if new:
                self._bar.update(new)
            self._bar.close()
            self._bar = None
        if (self._logged != self.done or self.done == self.start
                or self.done + self.ended < self.total):
            self.logger.info("%s", self.line(final=True))
