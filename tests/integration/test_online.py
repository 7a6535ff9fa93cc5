"""Online training (`eagle-ray train --conversations`): the features come from extractor
actors through the object store, never from a store on disk. Same samples and steps as an
offline run: the same held-out accuracy and the same online acceptance in vLLM."""

import os
from pathlib import Path

import pytest

from eagle_ray.recipes import load_recipe

pytestmark = pytest.mark.integration


# Steps enough to check behaviour (same weights online and offline, resume), not quality:
# the online job below keeps a quality floor.
STEPS = 8
SETS = ["generate.mode=keep_logged", "storage.dtype=fp32", "data.max_seq_len=128",
        "train.num_workers=2", f"train.max_steps={STEPS}", f"train.eval_interval={STEPS}",
        f"train.ckpt_interval={STEPS}", "train.log_interval=2", "train.cpus_per_worker=0.5",
        "extract.num_cpus_per_replica=0.5", "extract.max_replicas=2"]


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def offline(tmp_path_factory, ray_cluster, tiny_target_dir, make_logged_store):
    """A store of 160 logged conversations (and the conversations), and an offline run on it."""
    from eagle_ray.train.run import run_train

    d = tmp_path_factory.mktemp("online")
    r = load_recipe("tiny_cpu", SETS)
    store = make_logged_store(d, 160, 7, r)
    return d, store, run_train(r, store, d / "off")


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    return load_file(str(ckpt / "model.safetensors"))


@pytest.mark.long  # make test-all (README, Tests)
def test_killed_online_run_resumes_to_the_offline_weights_and_writes_no_features(
        offline, tmp_path, ray_cluster, kill_training):
    """Killed after its step-4 checkpoint, the online run resumes there (re-extracting from
    step 5 on) and ends with the weights of the uninterrupted OFFLINE run on the same samples
    and steps: online training is offline training without the store. Nothing but the run
    directory is written (no store, no shard), the object store never spills, and vLLM's
    per-request state files (through RAM, /dev/shm) are all gone."""
    import json

    import torch

    from eagle_ray.extract.vllm_capture import transfer_dir
    from eagle_ray.train.run import run_train

    d, _, _ = offline
    run = tmp_path / "killed"
    before = _files(d)
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    sets = SETS + ["train.ckpt_interval=2"]
    kill_training(["--conversations", str(d / "conv")] + [a for o in sets for a in ("--set", o)],
                  run, 4, ray_cluster, STEPS)
    m = run_train(load_recipe("tiny_cpu", sets), None, run, conversations=d / "conv")
    assert m["step"] == STEPS
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS, steps  # nothing logged twice
    a, b = _weights(d / "off"), _weights(run)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5, msg=k)

    assert _files(d) == before  # nothing written next to the conversations: no store
    assert not [f for f in _files(run) if "shard" in f or f.startswith("store")]
    assert m["online/spilled_bytes"] == 0
    if transfer_dir() == "/dev/shm":
        left = [str(p) for x in set(os.listdir("/dev/shm")) - shm_before
                for p in Path("/dev/shm", x).rglob("*") if p.is_file()]
        assert left == []


def test_whole_node_target_refuses_one_node():
    from eagle_ray.train.online import check_placement

    kimi = load_recipe("kimi_k25_8gpu")
    one = [{"Alive": True, "Resources": {"GPU": 8, "CPU": 192}}]
    tiny = load_recipe("tiny_cpu")
    check_placement(tiny, [{"Alive": True, "Resources": {"CPU": 2}}])  # 2 x 0.5 + 0.5 CPUs
    with pytest.raises(ValueError, match="CPUs"):
        check_placement(load_recipe("tiny_cpu", ["extract.max_replicas=3"]),
                        [{"Alive": True, "Resources": {"CPU": 2}}])
    with pytest.raises(ValueError, match="second node"):
        check_placement(kimi, one)
    check_placement(kimi, one + [{"Alive": True, "Resources": {"GPU": 8, "CPU": 192}}])
    llama = load_recipe("llama31_8b_8gpu", ["extract.max_replicas=4", "train.num_workers=4"])
    check_placement(llama, one)  # 4 extractors + 4 trainers on one 8-GPU node
    with pytest.raises(ValueError, match="9 GPUs"):
        check_placement(load_recipe("llama31_8b_8gpu", ["extract.max_replicas=5",
                                                        "train.num_workers=4"]), one)


OVERRIDES = ["train.max_steps=60", "train.eval_interval=60", "train.ckpt_interval=60",
             "train.cpus_per_worker=0.5", "extract.num_cpus_per_replica=0.5", "extract.max_replicas=2",
             "evaluate.seeds=0", "evaluate.prompts=24"]


@pytest.mark.long  # make test-all (README, Tests)
def test_online_job_end_to_end_and_resubmitted(tmp_path, ray_cluster):
    """The end-to-end job with --online on the sample data: ingest, generate, online
    training, export, check (reference features captured again), evaluate; no store and no
    feature bytes on disk. Run again, it finds every step complete and runs none."""
    import json

    from sample_data import small_sample_data
    from eagle_ray.job.pipeline import run_end_to_end

    r = load_recipe("tiny_cpu", OVERRIDES)
    out = tmp_path / "run"
    data = small_sample_data(150, 100)
    s = run_end_to_end(r, data, out, online=True)
    assert s["steps_run"] == ["ingest", "generate", "train", "export", "check", "evaluate", "serving"], \
        s["steps_run"]
    assert s["store_verify"]["online"] and not (out / "store").exists()
    from safetensors import safe_open

    files = list(out.rglob("*.safetensors"))  # drafter weights only, no hidden states
    assert files and not [p for p in files if {"aux", "final"} & set(safe_open(str(p), "pt").keys())]
    assert not list(out.rglob("*.safetensors.tmp"))
    assert json.loads((out / "train" / "online.json").read_text())["spilled_bytes"] == 0
    assert s["train"]["step"] == 60 and s["check"]["ok"]
    ev = s["evaluate"]
    assert ev["offline"] is None and ev["outputs_identical"]
    assert ev["online"]["mean_acceptance_length"] > ev["ngram"]["mean_acceptance_length"] + 0.5, ev

    again = run_end_to_end(r, data, out, online=True)
    assert again["steps_run"] == [] and again["train"]["step"] == 60

    # `eagle-ray evaluate` on the online-trained drafter, as a user runs it: exit 0, and it
    # says there are no offline figures (it used to run every engine, then die on a TypeError).
    import subprocess
    import sys

    sets = [a for o in OVERRIDES for a in ("--set", o)]
    p = subprocess.run([sys.executable, "-m", "eagle_ray.cli", "evaluate", "--drafter", str(out / "drafter"),
                        "--prompts", str(out / "ingest"), "--out", str(tmp_path / "ev"), "--seeds", "0",
                        "--limit", "8", *sets], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "RAY_ADDRESS": ray_cluster})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "offline none (trained online, without a store)" in p.stdout, p.stdout[-2000:]
    # Its console: four engines one after another in one child process, and not one vLLM
    # warning (the second engine used to print "Kernel ... is already registered" 11 times
    # and "Unknown vLLM environment variable detected: VLLM_DIST_IDENT"), no traceback.
    console = p.stdout + p.stderr
    assert "online run 4 of 4" in console, console[-3000:]
    noise = [line for line in console.splitlines()
             if "WARNING" in line or "Unknown vLLM environment variable" in line or "Traceback" in line]
    assert noise == [], noise[:10]
