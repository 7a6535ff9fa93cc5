"""Checkpoints: hashed, fsynced, renamed; the newest one that verifies wins; pruning."""

import pytest

from eagle_ray.train.checkpoint import (CheckpointError, checkpoints, commit_checkpoint,
                                        newest_loadable, prune)


def _save(run, step):
    tmp = run / "checkpoints" / f"step-{step:07d}.tmp"
    (tmp / "rng").mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(bytes(range(100)))
    (tmp / "rng" / "rank0.pt").write_bytes(b"rng")
    return commit_checkpoint(tmp, run / "checkpoints" / f"step-{step:07d}",
                             {"step": step, "epoch": 0, "step_in_epoch": step})


def test_newest_intact_checkpoint_is_chosen_and_damage_is_named(tmp_path, caplog):
    assert newest_loadable(tmp_path) is None
    for step in (1, 2, 3):
        _save(tmp_path, step)
    (tmp_path / "checkpoints" / "step-0000004.tmp").mkdir()  # a save that was killed
    assert newest_loadable(tmp_path).name == "step-0000003"
    w = tmp_path / "checkpoints" / "step-0000003" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:50])  # truncated
    (tmp_path / "checkpoints" / "step-0000002" / "rng" / "rank0.pt").write_bytes(b"RNG")  # flipped
    assert newest_loadable(tmp_path).name == "step-0000001"
    assert "step-0000003/model.safetensors has 50 bytes, 100 were written" in caplog.text
    assert "rank0.pt does not match its recorded hash" in caplog.text
    (tmp_path / "checkpoints" / "step-0000001" / "state.json").write_text("{")
    with pytest.raises(CheckpointError, match="no checkpoint in .* loads"):
        newest_loadable(tmp_path)


def test_redo_a_step_and_keep_the_newest_n(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    _save(tmp_path, 3)  # a resumed run redoes step 3 over a damaged one
    prune(tmp_path, 2)
    assert [p.name for p in checkpoints(tmp_path)] == ["step-0000003", "step-0000002"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == \
        ["step-0000002", "step-0000003"]
