"""Known-harmless lines that Ray's C++ core writes straight to a process's stderr.

Some lines never pass through Python logging, so `common/logs` cannot route them: Ray's core
worker writes them to file descriptor 2 from C++, in the driver (and, for actors, in the
actor's process, whose stderr Ray then prints on the driver's). The one met on a successful
run today, on every Ray Data actor pool and on Ray Train's PreemptionWatcher:

    [... E 11550 11550] core_worker.cc:2465: Actor with class name: 'MapWorker(...)' ...
    has constructor arguments in the object store and max_restarts > 0. ...

(ray-project/ray#57733, open.) The driver also prints, on its stderr, what the raylet
writes to raylet.err (Ray's log monitor): its note that more Python workers started at once
than the node has CPUs is expected when `eagle-ray curve` trains its fractions side by side.
Nothing in eagle_ray can stop Ray printing these, so
`install(log_dir)` puts a filter between this process's file descriptor 2 and where it
pointed: a small child process (this module's `main`) reads every byte written to fd 2 and
passes it on unchanged, except whole lines matching `KNOWN` (or all of a `KNOWN_ALL` entry), which go to
OUT/logs/native-stderr-<pid>.log with the reason. Crash output is safe: the filter is a
separate process that ignores SIGINT/SIGTERM and runs until the last writer has closed the
pipe, so a traceback, a C++ abort or a fatal signal's dump printed as this process dies still
reaches the console; at a normal exit `restore()` (atexit) puts fd 2 back and waits for the
filter to drain, so a job log follower sees the last line before the job ends.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from pathlib import Path

# A substring of the line -> why it is harmless here (written next to it in the log file).
KNOWN = {
    "has constructor arguments in the object store and max_restarts > 0":
        "Ray's core prints this for every Ray Data actor pool and Ray Train's PreemptionWatcher "
        "(ray-project/ray#57733); their constructor arguments live as long as the driver, and "
        "an actor that could not restart would fail the stage loudly, not silently",
}
# Lines known by several substrings at once (all present) -> why.
KNOWN_ALL = {
    # Ray repeats it at 2x, 4x, 6x, ... the node's CPUs, one line each.
    ("(raylet)", "PYTHON worker processes have been started", "x the maximum expected startup concurrency"):
        "the raylet counts Python workers starting at once against the node's CPUs; "
        "`eagle-ray curve` starts its fractions' trainings side by side and Ray Data pools "
        "ask for fractional CPUs, on purpose: the workers start (more slowly) and nothing waits "
        "on them wrongly",
}

_state: dict = {}


def known(line: bytes) -> str | None:
    text = line.decode("utf-8", "replace")
    for needle, why in KNOWN.items():
        if needle in text:
            return why
    for needles, why in KNOWN_ALL.items():
        if all(n in text for n in needles):
            return why
    return None


def install(log_dir: str | Path) -> bool:
    """Filter this process's fd 2 (see the module docstring). Idempotent; returns whether a
    filter is in place. Does nothing where fd 2 is closed or the filter cannot start."""
    if _state.get("pid") == os.getpid():
        return True
    try:
        os.fstat(2)
    except OSError:
        return False
    try:
        tty = os.isatty(2)
        saved = os.dup(2)
        r, w = os.pipe()
        log = Path(log_dir) / f"native-stderr-{os.getpid()}.log"
        proc = subprocess.Popen([sys.executable, "-m", "eagle_ray.common.native_stderr", str(log)],
                                stdin=r, stdout=saved, stderr=subprocess.DEVNULL, close_fds=True)
    except OSError:
        return False
    os.close(r)
    _flush_python_stderr()
    os.dup2(w, 2)
    os.close(w)
    _state.update(pid=os.getpid(), saved=saved, proc=proc, tty=tty)
    atexit.register(restore)
    return True


def console_is_tty() -> bool | None:
    """Whether fd 2 was a terminal before this process's filter (None: no filter here)."""
    return _state.get("tty") if _state.get("pid") == os.getpid() else None


def restore(timeout_s: float = 5.0) -> None:
    """Point fd 2 back where it was and let the filter print what it holds."""
    if _state.get("pid") != os.getpid():
        return
    _flush_python_stderr()
    os.dup2(_state["saved"], 2)  # our write end of the pipe closes with it
    os.close(_state["saved"])
    proc = _state.pop("proc")
    _state.clear()
    try:  # other holders of the pipe (a child that inherited fd 2) may keep it open
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass


def _flush_python_stderr() -> None:
    for f in (sys.stderr, sys.__stderr__):
        try:
            f.flush()
        except (AttributeError, ValueError, OSError):
            pass


def main(log_path: str) -> int:
    import signal

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)  # the process we serve decides when we end: at EOF
    out = sys.stdout.buffer
    passing = False  # this line's start was already passed on (a partial write): pass the rest
    while True:
        try:
            chunk = os.read(0, 65536)
        except InterruptedError:
            continue
        if not chunk:
            return 0
        lines = chunk.split(b"\n")
        tail = lines.pop()
        for line in lines:
            why = None if passing else known(line)
            passing = False
            if why is None:
                _write(out, line + b"\n")
            else:
                _note(log_path, line, why)
        if tail:  # a partial line (a prompt, a progress bar): now, unfiltered
            _write(out, tail)
            passing = True


def _write(out, data: bytes) -> None:
    try:
        out.write(data)
        out.flush()
    except (BrokenPipeError, OSError):
        pass


def _note(log_path: str, line: bytes, why: str) -> None:
    try:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as f:
            f.write(time.strftime("%Y-%m-%d %H:%M:%S ").encode() + line
                    + f"\n    (not on the console: {why})\n".encode())
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
