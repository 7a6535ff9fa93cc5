"""Progress lines: done/total, rates over this run's work only, an ETA."""

import logging

from eagle_ray.common import progress
from eagle_ray.common.progress import Progress, hms


def test_hms():
    assert [hms(s) for s in (0, 35, 60, 280, 3600, 3720)] == ["0s", "35s", "1m00s", "4m40s", "1h00m", "1h02m"]
    assert hms(float("inf")) == "?"


def test_line_counts_this_runs_rate_and_eta(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    monkeypatch.setenv("EAGLE_RAY_PLAIN_PROGRESS", "1")
    p = Progress("extract", 1000, start=400, interval_s=10, logger=logging.getLogger("eagle_ray.t"))
    with caplog.at_level(logging.INFO, logger="eagle_ray.t"):
        now[0] = 110.0
        p.update(100, tokens=50_000, bytes=2_000_000_000)  # 10 s: 10 samples/s (not 50)
        now[0] = 112.0
        p.update(20)  # within the interval: no line
        p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0] == ("extract: 500/1,000 samples (50%), 10.0 samples/s, 5,000 tokens/s, "
                        "2.00 GB written, ETA 50s")
    # closed short of its total (rejected prompts yield no sample): no ETA on the last line
    assert "520/1,000" in lines[1] and "ETA" not in lines[1] and "done in 12s" in lines[1]
    assert "ETA 48s" in p.line()
    now[0] = 140.0
    p.update(480, force=True)
    assert p.eta_s() == 0 and "done in 40s" in p.line()
