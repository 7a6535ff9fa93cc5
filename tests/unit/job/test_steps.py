"""The job's loop (job/pipeline.run_steps) on stand-in steps: what it skips, runs, records,
prints and stops on. The real steps run in tests/integration (test_job, test_online)."""

import pytest

from eagle_ray.job.pipeline import OFFLINE_STEPS, ONLINE_STEPS, Job, Step, run_steps


def _steps(log: list[str], complete: set[str], works: set[str], bad: dict[str, list[str]] | None = None,
           fatal: bool = True) -> list[Step]:
    bad = bad or {}

    def make(name):
        def run(job):
            log.append(name)
            return name in works
        return Step(name, (name,), lambda job: name in complete, run, lambda job: f"{name}: line",
                    lambda job: bad.get(name, []), fatal=fatal)
    return [make(n) for n in ("a", "b", "c")]


def test_complete_steps_are_skipped_until_one_does_work(tmp_path, capsys):
    log, timings = [], {}
    ran = run_steps(Job(None, [], tmp_path, False), _steps(log, complete={"a", "c"}, works={"b", "c"}), timings)
    # a: complete, skipped; b: not complete, did work; c: complete but stale after b's work.
    assert log == ["b", "c"] and ran == ["b", "c"] and set(timings) == {"a", "b", "c"}
    out = capsys.readouterr().out
    assert f"a: complete in {tmp_path / 'a'}, skipped" in out
    assert out.count(": line") == 3  # every step's summary, skipped or not


def test_a_step_with_nothing_left_to_do_is_not_recorded(tmp_path, capsys):
    log = []
    ran = run_steps(Job(None, [], tmp_path, False), _steps(log, complete={"c"}, works=set()), {})
    assert log == ["a", "b"] and ran == []
    assert f"b: complete in {tmp_path / 'b'}, nothing left to do" in capsys.readouterr().out


def test_problems_stop_the_job_or_are_printed(tmp_path, capsys):
    job = Job(None, [], tmp_path, False)
    with pytest.raises(ValueError, match="b failed: broken; worse"):
        run_steps(job, _steps([], set(), {"a", "b", "c"}, {"b": ["broken", "worse"]}), {})
    log = []
    ran = run_steps(job, _steps(log, set(), {"a", "b", "c"}, {"b": ["slow"]}, fatal=False), {})
    assert ran == ["a", "b", "c"] and "b: problem: slow" in capsys.readouterr().err


def test_the_job_tables_differ_only_in_the_generation_step():
    off, on = [s.name for s in OFFLINE_STEPS], [s.name for s in ONLINE_STEPS]
    assert off == ["ingest", "plan", "generate+extract", "train", "export", "check", "evaluate", "serving"]
    assert on == [n if n != "generate+extract" else "generate" for n in off]


def test_a_steps_wall_time_is_kept_by_the_submission_that_did_its_work(tmp_path):
    import json

    from eagle_ray.job.pipeline import STEP_WALL_FILE

    job = Job(None, [], tmp_path, False)
    run_steps(job, _steps([], complete=set(), works={"a", "b"}), {})
    first = json.loads((tmp_path / STEP_WALL_FILE).read_text())
    assert set(first) == {"a", "b"} and all(v["wall_s"] >= 0 for v in first.values())
    # resubmitted: a and b complete and skipped, c does its work; a's and b's records stay
    run_steps(job, _steps([], complete={"a", "b"}, works={"c"}), {})
    again = json.loads((tmp_path / STEP_WALL_FILE).read_text())
    assert set(again) == {"a", "b", "c"} and again["a"] == first["a"] and again["b"] == first["b"]
