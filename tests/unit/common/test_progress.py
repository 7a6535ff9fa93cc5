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


def test_units_that_end_without_output_finish_the_total_and_the_eta(monkeypatch, caplog):
    """A streamed run of 2,000 prompts where 374 are rejected as too long: they count toward
    the percentage and the ETA (said beside done), so the run reaches 100%, and an earlier
    run's rejects are not in this run's rate."""
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    monkeypatch.setenv("EAGLE_RAY_PLAIN_PROGRESS", "1")
    rejected = [100]  # an earlier run's
    p = Progress("generate+extract", 2000, start=400, interval_s=10, logger=logging.getLogger("eagle_ray.t"),
                 ended=lambda: rejected[0])
    with caplog.at_level(logging.INFO, logger="eagle_ray.t"):
        now[0] = 100.0
        rejected[0] = 200
        p.update(400)  # this run: 400 committed + 100 rejected in 100 s -> 5 finished a second
        assert p.ended == 200
        # 2,000 - 800 committed - 200 rejected = 1,000 to go at 5/s
        assert p.eta_s() == 200
        now[0] = 400.0
        rejected[0] = 374
        p.update(826)
        p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("generate+extract: 800/2,000 samples, 200 rejected (50%), 4.0 samples/s")
    assert lines[0].endswith("ETA 3m20s")
    assert lines[-1].startswith("generate+extract: 1,626/2,000 samples, 374 rejected (100%)")
    assert lines[-1].endswith("done in 6m40s")


def test_rejected_rows_counts_the_live_parts_once_each(tmp_path):
    """The streamed run's counter: non-ok rows of the live generation parts, each file read
    once; what is not a part is not counted."""
    import pyarrow as pa

    from eagle_ray.common.atomic import atomic_write_parquet
    from eagle_ray.stream.parts import RejectedRows

    def part(name, statuses):
        atomic_write_parquet(tmp_path / name, pa.table({"sample_id": [f"{name}-{i}" for i in range(len(statuses))],
                                                       "status": statuses}))

    count = RejectedRows(tmp_path)
    assert count() == 0
    part("part-1.parquet", ["ok", "rejected", "ok"])
    part("part-2.parquet", ["rejected", "rejected"])
    assert count() == 3
    (tmp_path / "broken.tmp").write_text("not a part")
    part("part-3.parquet", ["ok"])
    assert count() == 3
