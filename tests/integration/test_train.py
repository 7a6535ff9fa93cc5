"""Drafter training with Ray Train on the CPU (gloo): it learns, DDP == single worker with
the same global batch, and a killed run resumes to the same weights."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from eagle_ray.recipes import load_recipe

pytestmark = pytest.mark.integration

os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


@pytest.fixture(scope="module")
def store(tiny_trained):
    """~400 conversations, extracted from the tiny target (logged responses, HF backend)."""
    return tiny_trained[0] / "store"


def recipe(*extra):
    return load_recipe("tiny_cpu", ["train.cpus_per_worker=1", "train.log_interval=10", *extra])


def frequency_baseline(store_dir, run_dir):
    """Held-out step-0 accuracy of always predicting the most common loss token."""
    from eagle_ray.store.reader import HiddenStateStore
    from eagle_ray.targets.load import load_embed_and_lm_head

    info = json.loads((run_dir / "run.json").read_text())
    store = HiddenStateStore(store_dir)
    _, lm_head = load_embed_and_lm_head(info["target_dir"])
    hits = total = 0
    for sid in info["val_ids"]:
        s = store.get(sid)
        T = len(s["input_ids"])
        # step-0 targets: column t predicts x_{t+2} with teacher from final_{t+1}
        valid = s["loss_mask"][2:]
        teacher_argmax = (s["final"][1:T - 1] @ lm_head.float().T).argmax(-1)
        hits += int(((teacher_argmax == info["most_common_token"]) & valid).sum())
        total += int(valid.sum())
    return hits / total


def test_training_learns_far_above_untrained_and_frequency(tiny_trained):
    """The session's TINY_STEPS run (conftest.tiny_trained), which test_export_evaluate.py also
    serves and evaluates."""
    from sample_data import TINY_STEPS

    d, _ = tiny_trained
    store, run = d / "store", d / "run"
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in metrics if "val/acc_step0" in m][-1]
    assert last["step"] == TINY_STEPS
    untrained = metrics[0]["val/acc_step0"]
    trained = last["val/acc_step0"]
    baseline = frequency_baseline(store, run)
    print(f"held-out step-0 accuracy: untrained {untrained:.3f}, frequency baseline "
          f"{baseline:.3f}, trained {trained:.3f}; step-1 {last['val/acc_step1']:.3f}")
    assert trained > 0.4 and trained > untrained + 0.3 and trained > baseline + 0.2
    assert last["val/acc_step1"] > baseline  # later TTT steps learn too
    assert (run / "tensorboard").exists() and (run / "checkpoints" / f"step-{TINY_STEPS:07d}").exists()


def _weights(run):
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    return load_file(str(ckpt / "model.safetensors"))


def test_ddp_two_workers_equals_one_worker_same_global_batch(store, tmp_path):
    from eagle_ray.train.run import run_train

    common = ["train.max_steps=6", "train.eval_interval=1000", "train.ckpt_interval=6"]
    run_train(recipe(*common, "train.num_workers=2", "train.grad_accum=1"), store, tmp_path / "ddp")
    run_train(recipe(*common, "train.num_workers=1", "train.grad_accum=2"), store, tmp_path / "one")
    a, b = _weights(tmp_path / "ddp"), _weights(tmp_path / "one")
    assert a.keys() == b.keys()
    moved = _weights_changed(a, tmp_path / "ddp")
    assert moved
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4, msg=k)


def _weights_changed(w, run):
    return any(v.dtype.is_floating_point and v.abs().sum() > 0 for v in w.values())


@pytest.mark.long  # make test-all (README, Tests)
def test_killed_run_resumes_to_the_same_weights(store, tmp_path, ray_cluster, kill_training):
    from eagle_ray.train.run import run_train

    # Behaviour, not quality: 8 steps, a checkpoint every 2, killed after step 4's.
    sets = ["train.max_steps=8", "train.ckpt_interval=2", "train.eval_interval=1000",
            "train.log_interval=2"]
    run_train(recipe(*sets), store, tmp_path / "straight")

    run = tmp_path / "killed"
    kill_training(["--store", str(store)] + [a for o in ["train.cpus_per_worker=1", *sets]
                                               for a in ("--set", o)], run, 4, ray_cluster, 8)
    run_train(recipe(*sets), store, run)  # same RUN_DIR: resumes from the latest checkpoint
    steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 2, 4, 6, 8], steps  # rows past the checkpoint are not repeated
    a, b = _weights(tmp_path / "straight"), _weights(run)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5, msg=k)


def test_more_worker_cpus_than_the_cluster_has_is_refused_not_waited_for(store, tmp_path):
    """Ray Train would wait for the CPUs, retrying its start every minute and printing nothing
    a person can act on; the run is refused before it starts, naming both numbers."""
    from eagle_ray.train.run import run_train

    r = load_recipe("tiny_cpu", ["train.num_workers=2", "train.cpus_per_worker=3"])
    with pytest.raises(ValueError, match=r"2 worker\(s\) x 3 CPU = 6 CPUs but the Ray cluster has 4"):
        run_train(r, store, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()
