"""Fault matrix: nothing lost, nothing silent.

Each case injects one fault through the real CLI (a subprocess driver on the session's Ray)
and asserts what the issue asks: no foreign file deleted, no training on a damaged store,
no duplicate commits after concurrent runs (a clean refusal instead), resume from the
previous checkpoint after a truncated one, and never a traceback in the output. One small
store and one 2-step training run are built once and copied per case."""

import json
import re
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from eagle_ray.recipes import load_recipe
from eagle_ray.store.reader import check_store_whole, read_index, verify_store

pytestmark = pytest.mark.integration

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
SETS = ["generate.mode=keep_logged", "extract.backend=hf", "extract.num_cpus_per_replica=1",
        "extract.batch_size=8", "data.max_seq_len=96", "train.num_workers=1",
        "train.cpus_per_worker=1", "train.log_interval=1", "train.eval_interval=1000",
        "train.tokens_per_batch=512", "train.warmup_steps=1"]
N = 40


def cli(*args, env=None, ok=None, timeout=600):
    """Run `eagle-ray ARGS`; never a traceback; `ok` asserts the exit code (True: 0, False: 2)."""
    p = subprocess.run([sys.executable, "-m", "eagle_ray.cli", *map(str, args)],
                       capture_output=True, text=True, env=env, timeout=timeout)
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out[-4000:]
    if ok is not None:
        assert p.returncode == (0 if ok else 2), out[-4000:]
    return p


def sets(*extra):
    return [a for s in SETS + list(extra) for a in ("--set", s)]


@pytest.fixture(scope="module")
def base(tmp_path_factory, ray_cluster, tiny_target_dir, make_logged_store):
    """A 40-sample store (HF backend, no generation) and a 2-step run with 2 checkpoints."""
    from eagle_ray.train.run import run_train

    d = tmp_path_factory.mktemp("faults")
    recipe = load_recipe("tiny_cpu", SETS + ["train.max_steps=2", "train.ckpt_interval=1"])
    make_logged_store(d, N, 77, recipe)
    run_train(recipe, d / "store", d / "run")
    assert [p.name for p in sorted((d / "run" / "checkpoints").glob("step-*"))] == \
        ["step-0000001", "step-0000002"]
    return d, {**os.environ, "RAY_ADDRESS": ray_cluster}


def copy_store(base_dir, tmp_path):
    shutil.copytree(base_dir / "store", tmp_path / "store")
    return tmp_path / "store"


def train(store, run, env, *extra, ok=False):
    return cli("train", "--store", store, "--out", run, *sets("train.max_steps=2", *extra),
               env=env, ok=ok)


# --- outputs: nothing foreign is deleted ------------------------------------------------

def test_export_into_a_directory_of_other_files_is_refused(base, tmp_path):
    d, env = base
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    p = cli("export", "--run", d / "run", "--out", home, ok=False)
    assert str(home) in p.stderr and "did not write" in p.stderr
    assert sorted(os.listdir(home)) == ["thesis.tex"]
    for command in (["generate", "--prompts", d / "prompts", "--out", home, *sets()],
                    ["extract", "--conversations", d / "conv", "--out", home, *sets()],
                    ["train", "--store", d / "store", "--out", home, *sets()],
                    ["evaluate", "--drafter", d / "run", "--prompts", d / "prompts", "--out", home,
                     *sets()]):
        p = cli(*command, env=env, ok=False)
        assert str(home) in p.stderr, (command[0], p.stderr)
    assert sorted(os.listdir(home)) == ["thesis.tex"]
    assert (home / "thesis.tex").read_text() == "years of work"


def test_export_onto_a_file_leaves_nothing_and_reexport_swaps(base, tmp_path):
    d, env = base
    (tmp_path / "model").write_text("a file")
    p = cli("export", "--run", d / "run", "--out", tmp_path / "model", ok=False)
    assert "is a file" in p.stderr
    assert sorted(os.listdir(tmp_path)) == ["model"]
    out = tmp_path / "drafter"
    cli("export", "--run", d / "run", "--out", out, ok=True)
    first = (out / "config.json").read_text()
    cli("export", "--run", d / "run", "--out", out, ok=True)  # an earlier export: replaced
    assert json.loads((out / "config.json").read_text())["eagle_ray"]["trained"]
    assert json.loads(first)["eagle_ray"]["store"] == json.loads((out / "config.json").read_text())["eagle_ray"]["store"]
    assert sorted(os.listdir(tmp_path)) == ["drafter", "model"]  # no temporary left


# --- the store: training trusts it only when it is whole ----------------------------------

def _sample_bytes_at(store, sample_id):
    """(shard path, byte position of the sample's first aux row) in the shard file."""
    row = next(r for r in read_index(store).to_pylist() if r["sample_id"] == sample_id)
    path = store / "shards" / row["shard"]
    raw = path.read_bytes()
    seg = row["shard_offset"]  # the sample's segment (store/segments.py)
    n = int.from_bytes(raw[seg:seg + 8], "little")
    header = json.loads(raw[seg + 8:seg + 8 + n])
    start, end = header["aux"]["data_offsets"]
    rows = header["aux"]["shape"][0]
    return path, seg + 8 + n + start + row["offset"] * (end - start) // rows


def test_overwritten_bytes_stop_training_naming_sample_and_shard(base, tmp_path):
    d, env = base
    store = copy_store(d, tmp_path)
    sid = json.loads((d / "run" / "run.json").read_text())["val_ids"][0]  # read at step 0
    shard, pos = _sample_bytes_at(store, sid)
    with open(shard, "r+b") as f:
        f.seek(pos + 16)
        f.write(b"\xff" * 8)
    p = train(store, tmp_path / "run", env)
    assert sid in p.stderr and shard.name in p.stderr and "store repair" in p.stderr, p.stderr
    assert not list((tmp_path / "run").glob("checkpoints/step-*")), "trained on a damaged store"
    assert not verify_store(store)["ok"]
    cli("store", "repair", store, ok=True)
    rep = verify_store(store)
    assert rep["ok"] and rep["samples"] == N - 1


def test_lost_index_part_is_refused_then_repaired(base, tmp_path):
    d, env = base
    store = copy_store(d, tmp_path)
    part = sorted((store / "index").glob("part-*.parquet"))[0]
    lost = len(read_index(store)) - 0
    part.unlink()
    lost -= len(read_index(store))
    p = train(store, tmp_path / "run", env)
    # a lost part's segment: bytes of a shard no committed write owns (or, if it was the
    # shard's only write, an orphan shard)
    assert ("no committed write" in p.stderr or "orphan shard" in p.stderr), p.stderr
    assert "eagle-ray store repair" in p.stderr, p.stderr
    assert not (tmp_path / "run" / "run.json").exists()
    r = cli("store", "repair", store, ok=True)
    assert re.search(r"[1-9][\d,]* shard bytes no committed write owned|1 shard\(s\)", r.stdout), r.stdout
    assert verify_store(store)["ok"] and len(read_index(store)) == N - lost
    # the way back: extract redoes exactly the lost samples
    e = cli("extract", "--conversations", d / "conv", "--out", store, *sets(), env=env, ok=True)
    assert f"{lost:,} samples" in e.stdout
    assert verify_store(store)["ok"] and len(read_index(store)) == N


@pytest.mark.parametrize("damage", ["truncated_shard", "missing_shard", "manifest_keys",
                                    "truncated_index_part"])
def test_damaged_store_is_one_clear_line(base, tmp_path, damage):
    d, env = base
    store = copy_store(d, tmp_path)
    shard = sorted((store / "shards").iterdir())[0]
    if damage == "truncated_shard":
        shard.write_bytes(shard.read_bytes()[:-100])
        needle = shard.name
    elif damage == "missing_shard":
        shard.unlink()
        needle = f"missing shard {shard.name}"
    elif damage == "manifest_keys":
        m = json.loads((store / "manifest.json").read_text())
        del m["hidden_size"], m["aux_layer_ids"]
        (store / "manifest.json").write_text(json.dumps(m))
        needle = "manifest.json lacks required key(s) hidden_size, aux_layer_ids"
    else:
        part = sorted((store / "index").glob("part-*.parquet"))[0]
        part.write_bytes(part.read_bytes()[:50])
        needle = part.name
    p = train(store, tmp_path / "run", env)
    assert needle in p.stderr and len(p.stderr.strip().splitlines()[-1]) > 40, p.stderr
    v = cli("store", "verify", store)
    assert v.returncode in (1, 2) and needle.split()[-1] in v.stdout + v.stderr
    if damage != "manifest_keys":  # every failed verify has a way back
        cli("store", "repair", store, ok=True)
        assert verify_store(store)["ok"]


# --- writers: one per store; kill -9 and a full disk leave a store that resumes ----------

def _extract_cmd(d, store, *extra):
    return [sys.executable, "-m", "eagle_ray.cli", "extract", "--conversations", str(d / "conv"),
            "--out", str(store), *sets(*extra)]


def test_concurrent_extractions_refuse_instead_of_duplicating(base, tmp_path):
    d, env = base
    store = tmp_path / "store"
    first = subprocess.Popen(_extract_cmd(d, store, "extract.max_replicas=1"), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((store / ".lock").exists()
                                          and (store / ".lock").read_text()):
        assert first.poll() is None, first.communicate()[1][-3000:]
        time.sleep(0.05)
    second = cli("extract", "--conversations", d / "conv", "--out", store, *sets(), env=env,
                 ok=False)
    assert "in use by `eagle-ray extract` (pid" in second.stderr, second.stderr
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0 and "Traceback" not in out + err, err[-3000:]
    rep = verify_store(store)
    assert rep["ok"] and rep["samples"] == N and len(read_index(store)) == N, rep


def test_kill_9_mid_extraction_then_resume(base, tmp_path):
    d, env = base
    store = tmp_path / "store"
    proc = subprocess.Popen(_extract_cmd(d, store, "extract.max_replicas=1"), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not list((store / "index").glob("part-*.parquet")):
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(3)  # Ray reaps the dead driver's actors
    assert 0 < len(read_index(store)) < N, "the kill should land mid-run"
    cli("extract", "--conversations", d / "conv", "--out", store, *sets(), env=env, ok=True)
    # No repair step: an actor killed mid-write left at most an interrupted write, which the
    # re-run swept when it took the store (and a late one would not be damage either).
    rep = verify_store(store)
    assert rep["ok"] and rep["samples"] == N and len(read_index(store)) == N, rep
    check_store_whole(store)  # what training runs first


def test_full_disk_mid_extraction_is_one_line_and_resumes(base, tmp_path):
    """ENOSPC from the second shard write on: injected into the Ray workers of this job with
    a sitecustomize module (the job's runtime_env), since no test may fill a real disk."""
    d, env = base
    inject = tmp_path / "inject"
    inject.mkdir()
    # The second flush of shard bytes (a new shard or an appended segment) finds the disk
    # full: written bytes, then ENOSPC from fsync, as a real full disk reports it.
    (inject / "sitecustomize.py").write_text(
        "import errno, os\n"
        "_real, _calls = os.fsync, [0]\n"
        "def fsync(fd):\n"
        "    try:\n"
        "        shard = '/shards/' in os.readlink(f'/proc/self/fd/{fd}')\n"
        "    except OSError:\n"
        "        shard = False\n"
        "    if shard:\n"
        "        _calls[0] += 1\n"
        "        if _calls[0] > 1:\n"
        "            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
        "    return _real(fd)\n"
        "os.fsync = fsync\n")
    job = {"runtime_env": {"env_vars": {"PYTHONPATH": str(inject)}}}
    store = tmp_path / "store"
    p = cli("extract", "--conversations", d / "conv", "--out", store, *sets("extract.max_replicas=1"),
            env={**env, "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job)}, ok=False)
    last = p.stderr.strip().splitlines()[-1]
    assert "No space left on device" in last and "re-run `eagle-ray extract`" in last, p.stderr
    rep = verify_store(store)
    assert rep["ok"] and rep["samples"] == 8, rep  # the first batch only, nothing half-written
    cli("extract", "--conversations", d / "conv", "--out", store, *sets(), env=env, ok=True)
    assert verify_store(store)["ok"] and len(read_index(store)) == N


# --- checkpoints: a truncated one falls back to the previous ------------------------------

def test_truncated_checkpoint_falls_back_and_metrics_do_not_repeat(base, tmp_path):
    d, env = base
    run = tmp_path / "run"
    shutil.copytree(d / "run", run)
    weights = run / "checkpoints" / "step-0000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    e = cli("export", "--run", run, "--out", tmp_path / "drafter", ok=True)
    assert "skipping checkpoint" in e.stderr and "step-0000002" in e.stderr
    t = cli("train", "--store", d / "store", "--out", run, *sets("train.max_steps=3",
                                                                  "train.ckpt_interval=1"),
            env=env, ok=True)
    assert "step-0000002" in t.stderr and "truncated" in t.stderr
    steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3], steps  # step 2 was redone once, not repeated
    from eagle_ray.train.checkpoint import newest_loadable

    assert newest_loadable(run).name == "step-0000003"


# --- Ray start-up: a dead cluster record fails fast ---------------------------------------

def test_stale_cluster_record_fails_fast(base, tmp_path):
    d, env = base
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}")
    env = {k: v for k, v in env.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(tmp_path)}
    t0 = time.time()
    p = train(d / "store", tmp_path / "run", env)
    assert time.time() - t0 < 120
    assert "ray_current_cluster" in p.stderr and "stale cluster record" in p.stderr, p.stderr


# --- faults a person can act on: one line naming the cause and the way out ---------------

@pytest.mark.long  # make test-all (README, Tests)
def test_full_disk_while_writing_a_checkpoint_is_one_line_and_resumes(base, tmp_path):
    """The disk fills while rank 0 writes checkpoint step 2: torch.save's zip writer fails
    with its own words and no errno (what a full disk does to it); the filesystem reports no
    space. Injected into the Ray workers (sitecustomize in the job's runtime_env): no test may
    fill a real disk."""
    d, env = base
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import collections, shutil, torch\n"
        "_save, _calls = torch.save, [0]\n"
        "def save(obj, f, *a, **k):\n"
        "    if str(f).endswith('optim.pt'):\n"
        "        _calls[0] += 1\n"
        "        if _calls[0] > 1:\n"
        "            open(f, 'wb').write(b'PK partial')\n"
        "            shutil.disk_usage = lambda p: collections.namedtuple('u', 'total used free')(1 << 30, 1 << 30, 0)\n"
        "            raise RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598')\n"
        "    return _save(obj, f, *a, **k)\n"
        "torch.save = save\n")
    job = {"runtime_env": {"env_vars": {"PYTHONPATH": str(inject)}}}
    run = tmp_path / "run"
    p = train(d / "store", run, {**env, "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job)},
              "train.ckpt_interval=1", ok=False)
    last = p.stderr.strip().splitlines()[-1]
    assert ("disk full at" in last and "while writing checkpoint step-0000002" in last
            and "step-0000001 is intact" in last and "free space and re-run to resume" in last), p.stderr
    assert [c.name for c in (run / "checkpoints").glob("step-*")] == ["step-0000001"]
    train(d / "store", run, env, "train.ckpt_interval=1", ok=True)
    from eagle_ray.train.checkpoint import newest_loadable

    assert newest_loadable(run).name == "step-0000002"
    steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2], steps  # resumed from step 1: step 2 once


@pytest.mark.long  # make test-all (README, Tests)
def test_damaged_generation_part_is_redone_not_extracted_twice(base, tmp_path):
    """A truncated generate/parts/part-*.parquet: the re-run moves it to parts/damaged/ with a
    warning, generates its prompts again, and does not extract samples already in the store
    a second time."""
    d, env = base
    gen, store = tmp_path / "gen", tmp_path / "store"
    args = ["generate-extract", "--prompts", d / "prompts", "--generated", gen, "--out", store,
            *sets("generate.batch_size=8")]
    cli(*args, env=env, ok=True)
    parts = sorted((gen / "parts").glob("part-*.parquet"))
    assert len(parts) > 1 and len(read_index(store)) == N
    before = sorted(read_index(store).column("sample_id").to_pylist())
    ref = __import__("pyarrow.parquet", fromlist=["x"]).read_table(gen / "conversations.parquet")
    victim = parts[1]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    p = cli(*args, env=env, ok=True)
    assert f"{victim} does not read" in p.stderr and "generated again" in p.stderr, p.stderr[-3000:]
    assert (gen / "parts" / "damaged" / victim.name).exists()  # kept for inspection
    ids = read_index(store).column("sample_id").to_pylist()
    assert sorted(ids) == before and len(ids) == len(set(ids))  # none twice, none lost
    assert verify_store(store)["ok"]
    import pyarrow.parquet as pq

    again = pq.read_table(gen / "conversations.parquet")
    assert again.column("sample_id").to_pylist() == ref.column("sample_id").to_pylist()
    assert again.column("completion_token_ids").to_pylist() == ref.column("completion_token_ids").to_pylist()


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.long)])
def test_signal_to_a_running_extract_is_one_line_with_what_was_kept(base, tmp_path, sig):
    """`kill` (SIGTERM) and Ctrl-C (SIGINT) to `eagle-ray extract` mid-run: within seconds,
    exit 128+signal and one line naming the signal, the committed samples and the way on; no
    abort, no traceback. The re-run completes the store."""
    d, env = base
    store = tmp_path / "store"
    proc = subprocess.Popen(_extract_cmd(d, store, "extract.max_replicas=1", "extract.batch_size=1"),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not list((store / "index").glob("part-*.parquet")):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    t0 = time.time()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    took = time.time() - t0
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    assert took < 30, f"{took:.0f} s to stop"
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"eagle-ray extract: stopped by {name};") and "committed in" in last \
        and "re-run the same command to resume" in last, err[-3000:]
    assert "Traceback" not in out + err and "abort" not in (out + err).lower(), err[-3000:]
    cli("extract", "--conversations", d / "conv", "--out", store, *sets(), env=env, ok=True)
    rep = verify_store(store)
    assert rep["ok"] and rep["samples"] == N and len(read_index(store)) == N, rep
