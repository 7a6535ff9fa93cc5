"""SIGTERM / SIGINT raise Stopped in the main thread: a command can end in one line."""

import subprocess
import sys

CODE = """
import os, signal, time
from eagle_ray.common import signals
signals.install()
try:
    os.kill(os.getpid(), signal.{sig})
    time.sleep(10)
except signals.Stopped as s:
    print("stopped by", s, s.exit_code)
    raise SystemExit(s.exit_code)
"""


def test_sigterm_and_sigint_raise_stopped():
    for sig, code in (("SIGTERM", 143), ("SIGINT", 130)):
        p = subprocess.run([sys.executable, "-c", CODE.format(sig=sig)], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == code and p.stdout.strip() == f"stopped by {sig} {code}", p.stderr
