"""Quiet console, everything in OUT/logs: the filter, the per-process files, the libraries'
own config files (vLLM's dictConfig applied for real), user paths in a Ray job."""

import io
import json
import logging
import logging.config
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle_ray.common import logs


@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.delenv(logs.LEVEL_ENV, raising=False)
    yield
    for h in list(logging.getLogger().handlers):
        if getattr(h, "eagle_ray_handler", False):
            logging.getLogger().removeHandler(h)


def _rec(name, level, msg="m"):
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_console_shows_our_info_and_everyones_warnings(quiet):
    f = logs.ConsoleFilter()
    assert f.filter(_rec("eagle_ray.generate.run", logging.INFO))
    assert not f.filter(_rec("eagle_ray.generate.run", logging.DEBUG))
    assert not f.filter(_rec("vllm.v1.engine.core", logging.INFO))
    assert not f.filter(_rec("ray.data._internal.logging_progress", logging.INFO))
    assert f.filter(_rec("vllm.v1.engine.core", logging.WARNING))
    assert f.filter(_rec("torch.distributed", logging.ERROR))
    # a known-harmless source: its warnings to the file only, its errors still shown
    assert not f.filter(_rec("vllm.platforms.cpu", logging.WARNING))
    assert f.filter(_rec("vllm.platforms.cpu", logging.ERROR))


def test_verbose_shows_everything(quiet, monkeypatch):
    monkeypatch.setenv(logs.LEVEL_ENV, "DEBUG")
    f = logs.ConsoleFilter()
    assert f.filter(_rec("vllm.v1.engine.core", logging.INFO))
    assert f.filter(_rec("vllm.platforms.cpu", logging.WARNING))


def test_setup_writes_everything_to_the_run_log_and_little_to_the_console(quiet, tmp_path):
    stream = io.StringIO()
    log_dir = logs.setup(tmp_path / "run", stream=stream)
    assert log_dir == (tmp_path / "run" / "logs").resolve()
    assert not log_dir.exists()  # created at the first record, not before
    logging.getLogger("eagle_ray.extract").info("extract: 3/10 samples")
    logging.getLogger("somelib.worker").info("KV cache layout chatter")
    logging.getLogger("somelib.worker").warning("a real warning")
    console = stream.getvalue()
    assert "extract: 3/10 samples" in console and "a real warning" in console
    logging.getLogger("eagle_ray.targets").info("a library's bar", extra={logs.FILE_ONLY: True})
    assert "chatter" not in console and "bar" not in stream.getvalue()
    files = list(log_dir.glob(f"driver-{os.getpid()}.log"))
    assert len(files) == 1
    text = files[0].read_text()
    assert "chatter" in text and "extract: 3/10" in text and "a real warning" in text
    assert "a library's bar" in text


def test_vllm_config_file_is_a_valid_dictconfig_for_every_vllm_process(quiet, tmp_path):
    """What vLLM applies itself from VLLM_LOGGING_CONFIG_PATH in a fresh process (as an
    engine core is): INFO to that process's file, not to the console."""
    logs.setup(tmp_path / "run")
    path = os.environ["VLLM_LOGGING_CONFIG_PATH"]
    code = ("import json, logging, logging.config, sys\n"
            f"logging.config.dictConfig(json.load(open({path!r})))\n"
            "logging.getLogger('vllm.engine').info('engine chatter')\n"
            "logging.getLogger('vllm.engine').warning('engine warning')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ}, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "engine warning" in p.stderr and "engine chatter" not in p.stderr + p.stdout
    vllm_files = list((tmp_path / "run" / "logs").glob("vllm-*.log"))
    assert len(vllm_files) == 1 and "engine chatter" in vllm_files[0].read_text()
    ray_data = json.loads(Path(os.environ["RAY_DATA_LOGGING_CONFIG"]).read_text())
    assert ray_data["handlers"]["console"]["level"] == "WARNING"


def test_process_file_handler_writes_one_file_per_process_after_fork(tmp_path):
    h = logs.ProcessFileHandler(str(tmp_path), "w")
    h.emit(_rec("x", logging.INFO, "parent"))
    pid = os.fork()
    if pid == 0:
        h.emit(_rec("x", logging.INFO, "child"))
        os._exit(0)
    os.waitpid(pid, 0)
    assert "parent" in (tmp_path / f"w-{os.getpid()}.log").read_text()
    child = (tmp_path / f"w-{pid}.log").read_text()
    assert "child" in child and "parent" not in child


def test_paths_in_a_ray_job_are_the_users(monkeypatch):
    here = str(Path(logs.__file__).resolve().parents[2])
    monkeypatch.setenv(logs.SUBMITTED_FROM_ENV, "/home/me/eagle_ray")
    assert logs.display_path(here + "/examples/data/personal.jsonl") == \
        "/home/me/eagle_ray/examples/data/personal.jsonl"
    assert logs.display_path("/data/mine.jsonl") == "/data/mine.jsonl"
    monkeypatch.delenv(logs.SUBMITTED_FROM_ENV)
    assert logs.display_path(here + "/x") == here + "/x"


def test_a_ray_data_issue_repeated_every_30_s_is_on_the_console_once(quiet):
    """Ray Data's high-memory detector re-logs its finding every 30 s, numbers changing; the
    console shows it (and its "Found 1 issues") once, a new finding again; the file all."""
    f = logs.ConsoleFilter()

    def issue(msg):
        r = logging.LogRecord("ray.data._internal.issue_detection.issue_detector_manager",
                              logging.WARNING, "/x/" + logs.ISSUE_DETECTOR_FILE, 79, msg, None, None)
        return f.filter(r)

    mem = ("\n\nOperator 'MapBatches(ExtractUDF)' uses {}GiB of memory per worker on average "
           "(up to {}GiB), but Ray only requests 3.4GiB per worker.\nconsider `memory={}`")
    found = "Found 1 issues. To disable issue detection, run ..."
    assert issue(mem.format("3.4", "4.0", 5412131840)) and issue(found)
    assert not issue(mem.format("3.5", "4.2", 5612131840)) and not issue(found)
    assert issue(mem.replace("ExtractUDF", "GenerateUDF").format("3.4", "4.0", 1)) and issue(found)
    # other Ray Data warnings are untouched
    assert f.filter(_rec("ray.data._internal.execution", logging.WARNING))


def test_ray_saying_token_auth_is_on_is_dropped_and_saying_it_is_off_is_kept(quiet):
    logs.quiet_known_loggers()
    logs.quiet_known_loggers()  # idempotent: one filter
    lg = logging.getLogger(logs.RAY_AUTH_LOGGER)
    assert len(lg.filters) == 1

    def shown(msg):
        return lg.filter(logging.LogRecord(lg.name, logging.WARNING, __file__, 1, msg, None, None))

    assert not shown("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
    assert shown("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
