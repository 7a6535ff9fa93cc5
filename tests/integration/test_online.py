"""Online training (`eagle-ray train --conversations`): the features come from extractor
actors through the object store, never from a store on disk. Same samples and steps as an
offline run: the same held-out accuracy and the same online acceptance in vLLM."""

import os
from pathlib import Path

import pytest

from eagle_ray.recipes import load_recipe

pytestmark = pytest.mark.integration


SETS = ["generate.mode=keep_logged", "storage.dtype=fp32", "data.max_seq_len=128",
        "train.num_workers=2", "train.max_steps=40", "train.eval_interval=40",
        "train.ckpt_interval=40", "train.log_interval=10", "train.cpus_per_worker=0.5",
        "extract.num_cpus_per_replica=0.5", "extract.max_replicas=2"]


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def offline(tmp_path_factory, ray_cluster, tiny_target_dir, make_logged_store):
    """A store of 400 logged conversations (and the conversations), and an offline run on it."""
    from eagle_ray.train.run import run_train

    d = tmp_path_factory.mktemp("online")
    r = load_recipe("tiny_cpu", SETS)
    store = make_logged_store(d, 400, 7, r)
    return d, store, run_train(r, store, d / "off")


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    return load_file(str(ckpt / "model.safetensors"))


def test_online_equals_offline_and_writes_no_features(offline):
    from eagle_ray.evaluate.acceptance import online_runs_isolated, prompts_from_ingest
    from eagle_ray.vllm.engine import engine_kwargs
    from eagle_ray.export.drafter import export_drafter
    from eagle_ray.extract.vllm_capture import transfer_dir
    from eagle_ray.train.run import run_train
    from transformers import AutoTokenizer

    tmp_path, store, off = offline
    r = load_recipe("tiny_cpu", SETS)
    conv = tmp_path / "conv"

    before = _files(tmp_path) - {f for f in _files(tmp_path) if f.startswith("on/")}
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    on = run_train(r, None, tmp_path / "on", conversations=conv)
    new = _files(tmp_path) - before
    # Nothing but the run directory was written, and no hidden state in it: no store, no shard.
    assert all(f.startswith("on/") for f in new), sorted(new)[:5]
    assert not any("shard" in f or f.startswith("on/store") for f in new)
    assert on["online/spilled_bytes"] == 0  # the object store never spilled to disk
    # vLLM's per-request state files went through RAM (/dev/shm), and none is left there.
    if transfer_dir() == "/dev/shm":
        left = [str(p) for d in set(os.listdir("/dev/shm")) - shm_before
                for p in Path("/dev/shm", d).rglob("*") if p.is_file()]
        assert left == []

    # Same samples, same steps: held-out accuracy within 0.05 (the batch plan is the same).
    assert on["step"] == off["step"] == 40
    assert abs(on["val/acc_step0"] - off["val/acc_step0"]) <= 0.05, (on, off)

    # Exported drafters served by vLLM: online acceptance within 0.3 of each other.
    d_off = export_drafter(tmp_path / "off", tmp_path / "drafter_off")
    d_on = export_drafter(tmp_path / "on", tmp_path / "drafter_on")
    # check without a store: a held-out sample's features are captured again and compared
    # with what vLLM feeds the online-trained drafter.
    from eagle_ray.evaluate.check import run_check

    chk = run_check(r, d_on, None)
    assert chk.ok, chk.problems
    assert chk.details["tokens_compared"] > 0
    from eagle_ray.targets.resolve import resolve_target_path

    model = str(resolve_target_path(r.target))
    tok = AutoTokenizer.from_pretrained(model)
    import json

    prompts = prompts_from_ingest(tmp_path / "prompts", tok, 24,
                                  exclude_ids=set(json.loads(
                                      (tmp_path / "off" / "run.json").read_text())["train_ids"]))
    ekw = engine_kwargs(r, model)
    runs = online_runs_isolated(ekw, prompts, 48, {
        name: {"method": "eagle3", "model": str(d), "num_speculative_tokens": 3}
        for name, d in (("offline", d_off), ("online", d_on))})
    al = {name: res["mean_acceptance_length"] for name, res in runs.items()}
    print("online training: val acc0", on["val/acc_step0"], "offline", off["val/acc_step0"],
          "; vLLM mean acceptance length", al, "; tokens/s online", on["train/tokens_per_s"],
          "offline", off["train/tokens_per_s"])
    assert abs(al["online"] - al["offline"]) <= 0.3, al
    assert al["online"] > 1.3, al  # it learned something


def test_killed_online_run_resumes_from_its_data_position(offline, tmp_path, ray_cluster,
                                                          kill_training):
    """Killed after its step-20 checkpoint, the online run resumes there (re-extracting from
    step 21 on) and ends with the weights of the uninterrupted offline run."""
    import json

    import torch

    from eagle_ray.train.run import run_train

    d, _, _ = offline
    run = tmp_path / "killed"
    sets = SETS + ["train.ckpt_interval=10"]
    kill_training(["--conversations", str(d / "conv")] + [a for o in sets for a in ("--set", o)],
                    run, 20, ray_cluster, 40)
    m = run_train(load_recipe("tiny_cpu", sets), None, run, conversations=d / "conv")
    assert m["step"] == 40
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 40, steps  # nothing logged twice
    a, b = _weights(d / "off"), _weights(run)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5, msg=k)


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
    assert s["steps_run"] == ["ingest", "generate", "train", "export", "check", "evaluate"], s["steps_run"]
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
