"""SIGTERM and Ctrl-C end a command in one line, with what was committed.

`kill` and schedulers send SIGTERM; once Ray is connected its core worker's own handler
turns that into a C++ abort (exit 134, a stack dump). `install()` (the CLI and the job call
it at start, `init_ray` again once Ray is up) makes both signals raise `Stopped` in the main
thread instead: the stage's `finally` blocks run, every write already committed stays (all
writes are atomic), and the command prints one line naming the signal, what is kept and how
to resume. A second signal while stopping ends the process at once.
"""

from __future__ import annotations

import os
import signal
import threading


class Stopped(BaseException):
    """The command was asked to stop (SIGTERM or SIGINT). A BaseException, like
    KeyboardInterrupt, so `except Exception` in the stages does not swallow it."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_stopping = False
INSTALLED_ENV = "EAGLE_RAY_SIGNALS_PID"  # set in the process that installed the handlers


def _handler(signum, frame) -> None:
    global _stopping
    if _stopping:  # a second signal: no more clean-up
        os._exit(128 + signum)
    _stopping = True
    raise Stopped(signum)


def install() -> None:
    """SIGTERM and SIGINT raise Stopped in the main thread (no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _handler)
    os.environ[INSTALLED_ENV] = str(os.getpid())
