"""User-facing faults: find the one that matters inside Ray's wrappers.

A bad store, manifest, checkpoint, path or a full disk is the user's to fix, and the CLI
prints it as one line naming the file and the way out. Such an error often reaches the
driver wrapped: RayTaskError (an actor or task), Ray Train's WorkerGroupError /
ControllerError, Ray Data's UserCodeException, or chained with `raise ... from`.
`user_fault` walks those wrappers; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import re

# OSErrors that are about the machine, not the code.
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}


class UserFault(Exception):
    """Base of every error that is the user's to fix (a bad store, checkpoint, budget, a dead
    engine's cause): printed as one line by `run_for_a_person`. A stage defines its own
    errors by deriving from this (together with the builtin they are, e.g.
    `class StoreError(UserFault, RuntimeError)`), so this module knows no stage."""


# What a person fixes: our own UserFaults and builtin errors of input, paths and connections.
USER_TYPES = (UserFault, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
              PermissionError, ConnectionError)


def _is_user_fault(e: BaseException) -> bool:
    return isinstance(e, USER_TYPES) or (isinstance(e, OSError) and e.errno in DISK_ERRNOS)


def user_fault(e: BaseException) -> BaseException | None:
    """The user-facing fault in `e` or in what it wraps (breadth first), else None."""
    queue, seen = [e], set()
    while queue:
        x = queue.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        cause = getattr(x, "cause", None)  # RayTaskError: also an instance of its cause's type
        if isinstance(cause, BaseException):
            queue.insert(0, cause)
            continue
        if _is_user_fault(x):
            return x
        queue.extend([x.__cause__, x.__context__, getattr(x, "controller_failure", None)])
        failures = getattr(x, "worker_failures", None)  # Ray Train: rank -> exception
        if isinstance(failures, dict):
            queue.extend(failures.values())
    return _fault_in_text(e)


class ForwardedFault(UserFault, RuntimeError):
    """A user-facing fault known only from a remote traceback's text."""


# The exception line of a remote traceback: "eagle_ray.store.writer.StoreWriteError: msg".
_EXC_LINE = re.compile(r"^(?P<path>eagle_ray(?:\.\w+)+)\.(?P<cls>\w+): (?P<msg>.+)$", re.M)


def _fault_in_text(e: BaseException) -> BaseException | None:
    """Ray Data's UserCodeException loses its __cause__ when it is pickled back to the
    driver; the original survives only in the traceback text. Find our own user-fault
    exception line there."""
    import importlib

    texts, x, seen = [], e, set()
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        texts += [getattr(x, "traceback_str", "") or "", str(x)]
        x = getattr(x, "cause", None) or x.__cause__ or x.__context__
    for m in _EXC_LINE.finditer("\n".join(texts)):
        try:  # by the name in the text: this module imports no stage by itself
            cls = getattr(importlib.import_module(m.group("path")), m.group("cls"))
        except (ImportError, AttributeError):
            continue
        if isinstance(cls, type) and issubclass(cls, USER_TYPES):
            return ForwardedFault(m.group("msg"))
    return None


def one_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else type(e).__name__
    if isinstance(e, OSError) and e.errno in DISK_ERRNOS and e.filename and str(e.filename) not in text:
        text += f" ({e.filename})"
    return text


# "(RayTrainWorker pid=9745)" / "(ExtractUDF pid=1, ip=10.0.0.2)", maybe coloured: Ray's
# prefix on log lines it forwards from workers to the driver.
_RAY_PREFIX = re.compile(r"^(?:\x1b\[[0-9;]*m)?\((?P<who>[^()]*pid=\d+[^()]*)\)(?:\x1b\[0m)?\s?")
_CHAIN_LINES = ("During handling of the above exception", "The above exception was the direct")


class TracebackFilter:
    """A text stream wrapper that drops the stack frames of tracebacks (the driver's and
    those Ray forwards from workers), keeping each exception's message line. The CLI wraps
    stdout/stderr with it unless -v, so a user-facing fault prints as one line even when
    Ray logs it with its traceback in a worker."""

    def __init__(self, stream):
        self._stream = stream
        self._buf = ""
        self._skipping: set[str | None] = set()

    def write(self, text: str) -> int:
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self._line(line)
        return len(text)

    def _line(self, line: str) -> None:
        m = _RAY_PREFIX.match(line)
        who = m.group("who").split(",")[0] if m else None
        body = line[m.end():] if m else line
        if body.startswith("Traceback (most recent call last):"):
            self._skipping.add(who)
            return
        if body.startswith(_CHAIN_LINES):
            return
        if who in self._skipping:
            if not body.strip() or body[:1] in (" ", "\t"):
                return  # a frame, a source line, a caret line
            self._skipping.discard(who)  # the exception's own line: keep it
        self._stream.write(line + "\n")

    def flush(self) -> None:
        if self._buf:
            line, self._buf = self._buf, ""
            m = _RAY_PREFIX.match(line)
            if (m.group("who").split(",")[0] if m else None) not in self._skipping:
                self._stream.write(line)
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _stop_worker_output() -> None:
    """Stop printing what Ray forwards from workers (a replica still loading its weights
    when the signal came), so the stopped line is the console's last. The workers' own logs
    keep it. Ray 2.60 has no public switch; its driver prints through this dispatcher."""
    import sys

    if "ray" not in sys.modules:
        return
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher
    except ImportError:
        return
    global_worker_stdstream_dispatcher.remove_handler("ray_print_logs")


def run_for_a_person(fn, prog: str, *, verbose: bool, kept) -> int:
    """Run `fn()` (the CLI command, the job) and return its exit code, as a person should see
    it: tracebacks behind `verbose` (stdout/stderr wrapped in TracebackFilter otherwise, before
    `fn` sets up logging on them); SIGTERM/SIGINT end in one line `PROG: stopped by SIG; kept()`
    (exit 128+signal); a user-facing fault in one line `PROG: error: ...` (exit 2); a bug keeps
    its traceback."""
    import sys

    from eagle_ray.common import signals

    streams = sys.stdout, sys.stderr
    if not verbose:  # stack traces (ours, and those Ray forwards from workers) behind -v
        sys.stdout, sys.stderr = TracebackFilter(sys.stdout), TracebackFilter(sys.stderr)
    try:
        return fn()
    except signals.Stopped as s:
        _stop_worker_output()
        print(f"{prog}: stopped by {s}; {kept()}", file=sys.stderr)
        return s.exit_code
    except Exception as e:
        # Bad stores, manifests, checkpoints, paths, full disks (also inside Ray's wrappers):
        # one line naming the file and the way out; the stack trace only with -v.
        fault = user_fault(e)
        if fault is None:
            sys.stdout.flush()
            sys.stdout, sys.stderr = streams
            raise  # a bug: keep the traceback
        if verbose:
            import traceback

            traceback.print_exception(e)
        print(f"{prog}: error: {one_line(fault)}", file=sys.stderr)
        return 2
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
