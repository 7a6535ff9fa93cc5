"""The filter in front of a command's fd 2: Ray's known C++ line goes to the run's log with
its reason; everything else, crash output included, reaches the console unchanged."""

import signal
import subprocess
import sys
import textwrap

RAY_LINE = ("[2026-12-05 08:40:40,849 E 11550 11550] core_worker.cc:2465: Actor with class name: "
            "'MapWorker(MapBatches(GenerateUDF))' and ID: '5aa4' has constructor arguments in the "
            "object store and max_restarts > 0. If the arguments in the object store go out of "
            "scope or are lost, the actor restart will fail.")


def _run(tmp_path, body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import os, sys
        from eagle_ray.common import native_stderr
        assert native_stderr.install({str(tmp_path)!r})
        assert native_stderr.install({str(tmp_path)!r})  # idempotent
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)


def test_known_line_goes_to_the_log_with_its_reason_and_the_rest_passes_in_order(tmp_path):
    p = _run(tmp_path, f"""
        os.write(2, b"first\\n")
        os.write(2, {RAY_LINE.encode()!r} + b"\\n")
        os.write(2, b"(TrainController pid=12) " + {RAY_LINE.encode()!r} + b"\\nsecond\\n")
        os.write(2, b"a partial line ")
        os.write(2, b"ended later\\n")
        print("from python", file=sys.stderr)
        raise RuntimeError("the crash")
    """)
    err = p.stderr.decode()
    assert p.returncode == 1
    assert "core_worker" not in err and "max_restarts" not in err, err
    assert err.index("first") < err.index("second") < err.index("a partial line ended later") \
        < err.index("from python") < err.index("Traceback")
    assert "RuntimeError: the crash" in err
    logged = "".join(f.read_text() for f in tmp_path.glob("native-stderr-*.log"))
    assert logged.count("core_worker.cc:2465") == 2
    assert logged.count("(not on the console: Ray's core prints this") == 2


def test_output_written_before_a_kill_still_reaches_the_console(tmp_path):
    p = _run(tmp_path, """
        os.write(2, b"last words\\n")
        os.kill(os.getpid(), 9)
    """)
    assert p.returncode == -signal.SIGKILL
    assert b"last words" in p.stderr



def test_the_raylets_startup_concurrency_note_is_known_at_any_multiple():
    """`eagle-ray curve` starts its trainings side by side; the raylet's note about it (as
    the driver prints it, colour codes and dedup suffix included) goes to the log."""
    from eagle_ray.common.native_stderr import known

    for times in (4, 6):
        line = (f"\x1b[33m(raylet)\x1b[0m WARNING: {2 * times} PYTHON worker processes have been started "
                f"on node: 3e33 with address: 192.0.2.2, which is {times}x the maximum expected startup "
                "concurrency (2). This could be a result of using a large number of actors, tasks blocked "
                "in ray.get() calls, or tasks with fractional CPU requests (e.g., num_cpus=0.1) allowing "
                "high concurrency. See https://github.com/ray-project/ray/issues/3644 for some discussion "
                "of workarounds.\x1b[32m [repeated 2x across cluster]\x1b[0m")
        assert known(line.encode()) and "curve" in known(line.encode())
    assert known(b"(raylet) WARNING: the node is running low on memory") is None
