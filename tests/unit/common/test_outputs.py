"""Output directories are never someone else's; export swaps atomically; a dead Ray address
fails in bounded time."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from eagle_ray.common.outputs import (MARKER, OutputDirError, check_output_dir, claim_output_dir,
                                      replace_dir_atomically)


def test_new_empty_or_own_output_is_accepted_anything_else_refused(tmp_path):
    claim_output_dir(tmp_path / "new", "train")
    assert json.loads((tmp_path / "new" / MARKER).read_text())["command"] == "train"
    claim_output_dir(tmp_path / "new", "train")  # its own earlier output: resume
    (tmp_path / "empty").mkdir()
    claim_output_dir(tmp_path / "empty", "extract")
    with pytest.raises(OutputDirError, match="output of `eagle-ray train`"):
        claim_output_dir(tmp_path / "new", "extract")
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("precious")
    with pytest.raises(OutputDirError, match=f"{home} exists and holds files eagle-ray did not "
                                             "write \\(thesis.tex\\)"):
        claim_output_dir(home, "generate")
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputDirError, match="is a file"):
        claim_output_dir(tmp_path / "file", "evaluate")
    assert (home / "thesis.tex").read_text() == "precious" and sorted(os.listdir(home)) == ["thesis.tex"]
    legacy = tmp_path / "legacy_run"
    legacy.mkdir()
    (legacy / "run.json").write_text("{}")
    claim_output_dir(legacy, "train")  # written before the marker existed


def _write(files):
    def write(d):
        for name, text in files.items():
            (d / name).write_text(text)
    return write


def test_replace_is_atomic_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "drafter"
    only = ("config.json", "model.safetensors")
    replace_dir_atomically(out, "export", _write({"config.json": "1"}), only=only)
    replace_dir_atomically(out, "export", _write({"config.json": "2"}), only=only)
    assert (out / "config.json").read_text() == "2"

    def fail(d):
        (d / "config.json").write_text("3")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        replace_dir_atomically(out, "export", fail, only=only)
    assert (out / "config.json").read_text() == "2"
    assert sorted(os.listdir(tmp_path)) == ["drafter"]  # no temporary left
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match="notes.txt"):
        replace_dir_atomically(out, "export", _write({"config.json": "4"}), only=only)
    assert (out / "notes.txt").exists()
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputDirError, match="is a file"):
        replace_dir_atomically(tmp_path / "f", "export", _write({}), only=only)
    assert sorted(os.listdir(tmp_path)) == ["drafter", "f"]


def test_check_output_dir_creates_nothing(tmp_path):
    check_output_dir(tmp_path / "a" / "b", "export")
    assert not (tmp_path / "a").exists()


_CONNECT = """
import sys
from eagle_ray.ops.cluster import RayConnectError, init_ray
try:
    init_ray()
except RayConnectError as e:
    print(e)
    sys.exit(3)
"""


def _connect_in_fresh_process(env: dict) -> subprocess.CompletedProcess:
    """init_ray in a new interpreter: this test session may already have a Ray running
    (integration tests), and init_ray rightly reuses a connected one."""
    return subprocess.run([sys.executable, "-c", _CONNECT], env=env, capture_output=True,
                          text=True, timeout=120)


def test_stale_cluster_record_fails_fast_naming_it(tmp_path):
    with socket.socket() as s:  # a port nobody listens on: the head that died
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = str(tmp_path)
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}")
    t0 = time.time()
    p = _connect_in_fresh_process(env)
    assert p.returncode == 3, p.stdout + p.stderr
    assert re.search("ray_current_cluster is gone \\(a stale cluster record\\)", p.stdout), p.stdout
    p = _connect_in_fresh_process(env | {"RAY_ADDRESS": f"127.0.0.1:{port}"})
    assert p.returncode == 3 and re.search("from RAY_ADDRESS.*unset RAY_ADDRESS", p.stdout), p.stdout
    assert time.time() - t0 < 60  # two interpreters with imports, each connect bounded
