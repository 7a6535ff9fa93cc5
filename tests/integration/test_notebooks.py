"""The notebooks in notebooks/, executed top to bottom by a real Jupyter kernel (nbclient), as a
user would run them: 01 (ingest, stats, plan) and 03 (results of a finished run) without Ray,
02 against its own local Ray head and job. The kernel is a separate process: it never shares
this process's Ray (the session `ray_cluster` may be running at the same time; 02's head has
its own temp dir and free ports). The notebooks are stored as percent-format scripts
(jupytext `py:percent`: `# %%` code cells, `# %% [markdown]` cells), read into notebooks here."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
# Notebook 03 (results) reads the session's finished run: its test lives in
# test_kimi_pipeline.py, beside the other tests of that run.

REPO = Path(__file__).resolve().parents[2]
NB_DIR = REPO / "notebooks"
CELL_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def kernel_name(tmp_path_factory):
    """"python3", running this interpreter (the venv's): jupyter_client runs a spec whose argv
    starts with a bare `python` with sys.executable. When the spec found is another
    interpreter's, a spec pointing at sys.executable goes first on a temporary JUPYTER_PATH."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    def runs_this_python() -> bool:
        try:
            argv = KernelSpecManager().get_kernel_spec("python3").argv
        except NoSuchKernel:
            return False
        bare = {"python", f"python{sys.version_info[0]}", "python%d.%d" % sys.version_info[:2]}
        return bool(argv) and (argv[0] in bare or os.path.realpath(argv[0]) == os.path.realpath(sys.executable))

    old = os.environ.get("JUPYTER_PATH")
    if not runs_this_python():
        d = tmp_path_factory.mktemp("jupyter")
        spec = d / "kernels" / "python3"
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (eagle_ray venv)", "language": "python"}))
        os.environ["JUPYTER_PATH"] = os.pathsep.join([str(d)] + ([old] if old else []))
        assert runs_this_python(), KernelSpecManager().find_kernel_specs()
    yield "python3"
    if old is None:
        os.environ.pop("JUPYTER_PATH", None)
    else:
        os.environ["JUPYTER_PATH"] = old


def run_notebook(name: str, workdir: Path, kernel: str, **env: str):
    """Execute notebooks/NAME in a fresh kernel (cwd workdir, env: this process's without any
    Ray address or notebook input, plus env). Returns (notebook, text of all outputs, seconds);
    a failing cell raises CellExecutionError with its traceback."""
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    nb = jupytext.read(NB_DIR / name)
    kenv = {k: v for k, v in os.environ.items()
            if k != "RAY_ADDRESS" and not k.startswith("EAGLE_RAY_NB_")}
    kenv.update(env)
    client = NotebookClient(nb, kernel_name=kernel, timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(workdir)}})
    t0 = time.time()
    try:
        client.execute(env=kenv)
    finally:
        seconds = time.time() - t0
        # the executed notebook, for a failure
        (workdir / name).with_suffix(".ipynb").write_text(nbformat.writes(nb))
    print(f"{name}: {seconds:.0f} s")
    return nb, _text(nb), seconds


def _text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(out.text)
            elif out.output_type in ("execute_result", "display_data"):
                parts.append(out.data.get("text/plain", ""))
                parts.append(out.data.get("text/markdown", ""))
            elif out.output_type == "error":
                parts.append("\n".join(out.traceback))
    return "\n".join(parts)


def _group_runs(pgid: int, marker: str) -> bool:
    """Whether a process of process group pgid has marker in its command line."""
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid and \
                    marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False


def _images(nb) -> int:
    return sum("image/png" in out.get("data", {}) for c in nb.cells for out in c.get("outputs", []))


NOTEBOOKS = ("01_data_and_plan.py", "02_operate.py", "03_results.py")


def test_notebooks_are_percent_scripts_that_read_as_notebooks():
    import jupytext
    import nbformat

    assert sorted(p.name for p in NB_DIR.glob("*.py")) == sorted(NOTEBOOKS)
    assert not list(NB_DIR.glob("*.ipynb")), "notebooks are stored as percent scripts only"
    for name in NOTEBOOKS:
        compile((NB_DIR / name).read_text(encoding="utf-8"), name, "exec")
        nb = jupytext.read(NB_DIR / name)
        nbformat.validate(nb)
        assert nb.metadata.kernelspec.name == "python3"
        kinds = {c.cell_type for c in nb.cells}
        assert kinds == {"markdown", "code"} and len(nb.cells) > 5, (name, len(nb.cells))
        assert nb.cells[0].cell_type == "markdown" and "environment variable" in nb.cells[0].source


def test_01_data_and_plan(tmp_path, kernel_name, tiny_target_dir):
    nb, text, seconds = run_notebook("01_data_and_plan.py", tmp_path, kernel_name,
                                     EAGLE_RAY_NB_OUT=str(tmp_path / "out"))
    report = json.loads((tmp_path / "out" / "ingest" / "report.json").read_text())
    assert report["invariant"]["holds"] and report["accepted"] > 0
    assert (f"accepted {report['accepted']:,} + duplicates {report['duplicates']:,} + rejected "
            f"{report['rejected']:,} + sampled out {report['sampled_out']:,} = lines read "
            f"{report['lines_read']:,}: holds") in text
    assert "personal.jsonl" in text and "general_sharegpt.jsonl" in text  # per-source tables
    assert "57,344 bytes/token" in text  # Kimi-K2.5 bf16: 4 x 7168 x 2
    assert "28,688 bytes/token" in text  # fp8_e4m3
    assert "recipe                  kimi_k25_8gpu" in text and "NO, short by" in text
    for alternative in ("fewer_samples", "shorter_max_seq_len", "storage.dtype=fp8_e4m3"):
        assert f"alternative: {alternative}" in text
    assert "recipe                  tiny_cpu" in text
    assert _images(nb) >= 2  # length histograms, Kimi options
    assert seconds < 300


@pytest.mark.long  # make test-all (README, Tests)
def test_02_operate_a_running_job(tmp_path, kernel_name, tiny_target_dir):
    out = tmp_path / "out"
    try:
        # 6,000 conversations: extraction must outlast both scaling steps (2,400 finished
        # first once, on a machine shared with another test file).
        nb, text, seconds = run_notebook("02_operate.py", tmp_path, kernel_name,
                                         EAGLE_RAY_NB_OUT=str(out), EAGLE_RAY_NB_CONVERSATIONS="6000")
    finally:
        # The notebook stops the head it started (last cell, and atexit in the kernel); if the
        # kernel died before either ran, stop it here: its process group only, and only while
        # that group still runs processes of that head (named by its temp dir).
        if (out / "head.json").exists():
            from eagle_ray.job.launch import LocalHead

            h = json.loads((out / "head.json").read_text())
            if _group_runs(h["pgid"], h["temp_dir"]):
                LocalHead(temp_dir=Path(h["temp_dir"]), pgid=h["pgid"], gcs_address="",
                          dashboard_url="", metrics_url="").stop()
    assert "Ray dashboard: http://127.0.0.1:" in text
    assert "metadata recipe" in text and "tiny_cpu" in text
    assert "stage: generate+extract" in text
    assert "eagle_ray_samples_committed" in text and "/s" in text  # a rate from Prometheus
    assert "extract: 1 running, 0 draining" in text
    up, down = text.index("extract: desired 2 replicas"), text.index("extract: desired 1 replicas")
    assert "extract: 2 running, 0 draining" in text[up:down], text[up:down]
    assert "extract: 1 running, 0 draining" in text[down:], text[down:]
    assert "STOPPED" in text and "stopped the local Ray head" in text
    from eagle_ray.store.reader import read_index, verify_store

    store = out / "run" / "store"
    ids = read_index(store).column("sample_id").to_pylist()
    assert ids and len(ids) == len(set(ids)) and not verify_store(store)["problems"]
    print(f"02: {len(ids)} samples committed before the stop")
