import errno
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle_ray.store.format import StoreManifest
from eagle_ray.store.reader import HiddenStateStore, StoreError, read_index, verify_store
from eagle_ray.store.writer import SampleFeatures, StoreMismatchError, StoreWriter, StoreWriteError

H, A = 16, 3


def manifest(**kw):
    base = dict(target_path="t", target_revision=None, target_fingerprint="fp", architecture="Llama",
                hidden_size=H, num_layers=8, vocab_size=100, aux_layer_ids=(2, 4, 5), dtype="bf16",
                max_seq_len=64, tokenizer_fingerprint="tok")
    base.update(kw)
    return StoreManifest(**base)


def samples(n, seed=0, lengths=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = lengths[i] if lengths else 5 + 3 * i
        out.append(SampleFeatures(
            sample_id=f"s{seed}-{i}", source="src", input_ids=np.arange(T, dtype=np.int32) + i,
            loss_mask=np.arange(T) >= T // 2,
            aux=torch.randn(T, A * H, generator=g) * (1 + torch.arange(A).repeat_interleave(H)),
            final=torch.randn(T, H, generator=g), num_tokens_untruncated=T + (i == 0) * 10))
    return out


def test_bf16_round_trip_is_bit_exact_and_sliced(tmp_path):
    w = StoreWriter(tmp_path, manifest())
    ss = samples(4)
    w.write_shard(ss[:3])
    w.write_shard(ss[3:])
    store = HiddenStateStore(tmp_path)
    assert len(store) == 4
    for s in ss:
        got = store.get(s.sample_id, verify=True, dtype=torch.bfloat16)
        assert torch.equal(got["aux"], s.aux.to(torch.bfloat16))
        assert torch.equal(got["final"], s.final.to(torch.bfloat16))
        assert got["input_ids"].tolist() == s.input_ids.tolist()
        assert got["loss_mask"].tolist() == s.loss_mask.tolist()
    idx = read_index(tmp_path).to_pylist()
    assert [r["offset"] for r in idx] == [0, 5, 13, 0]
    assert idx[0]["truncated"] and not idx[1]["truncated"]
    assert idx[1]["num_loss_tokens"] == int(ss[1].loss_mask.sum())
    assert verify_store(tmp_path)["ok"]


def test_fp8_halves_bytes_with_small_error(tmp_path):
    ss = samples(3, lengths=[40, 40, 40])
    StoreWriter(tmp_path / "bf16", manifest()).write_shard(ss)
    StoreWriter(tmp_path / "fp8", manifest(dtype="fp8_e4m3")).write_shard(ss)
    b = HiddenStateStore(tmp_path / "bf16")
    f = HiddenStateStore(tmp_path / "fp8")
    for s in ss:
        x = f.get(s.sample_id, verify=True)
        rel = (x["aux"] - s.aux).norm() / s.aux.norm()
        assert 0 < rel < 0.05  # e4m3 has 3 mantissa bits: ~2-3% relative error
    def data_bytes(store_dir):  # safetensors file = 8-byte header length + header + data
        f = next((store_dir / "shards").iterdir()).read_bytes()
        return len(f) - 8 - int.from_bytes(f[:8], "little")

    T = 120
    assert data_bytes(tmp_path / "bf16") == T * ((A + 1) * H * 2 + 5)
    assert data_bytes(tmp_path / "fp8") == T * ((A + 1) * H * 1 + (A + 1) * 4 + 5)
    assert verify_store(tmp_path / "fp8")["ok"]
    assert b.get(0)["aux"].dtype == torch.float32


def test_corrupted_byte_is_caught(tmp_path):
    StoreWriter(tmp_path, manifest()).write_shard(samples(3))
    shard = next((tmp_path / "shards").iterdir())
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x40  # a byte inside the last tensor's data
    shard.write_bytes(bytes(data))
    rep = verify_store(tmp_path)
    assert not rep["ok"] and any("checksum mismatch" in p for p in rep["problems"])
    store = HiddenStateStore(tmp_path)
    bad = [sid for sid in store.sample_ids
           if not _ok(lambda: store.get(sid, verify=True))]
    assert len(bad) == 1


def _ok(fn):
    try:
        fn()
        return True
    except StoreError:
        return False


def test_mismatched_manifest_is_refused(tmp_path):
    StoreWriter(tmp_path, manifest()).write_shard(samples(1))
    for change in (dict(aux_layer_ids=(2, 4, 6)), dict(target_fingerprint="other"),
                   dict(tokenizer_fingerprint="x"), dict(dtype="fp8_e4m3")):
        with pytest.raises(StoreMismatchError, match=list(change)[0]):
            StoreWriter(tmp_path, manifest(**change))
    with pytest.raises(StoreError, match="aux_layer_ids"):
        HiddenStateStore(tmp_path, expect=manifest(aux_layer_ids=(1, 4, 5)))


@pytest.mark.parametrize("shard_bytes", [1, 1 << 30], ids=["new-shard", "append"])
def test_enospc_leaves_nothing_half_written(tmp_path, monkeypatch, shard_bytes):
    """A full disk while the shard bytes are flushed: of a new shard file or of a segment
    appended to the current one. Nothing of the batch stays (no file, no tail)."""
    import os

    w = StoreWriter(tmp_path, manifest(), shard_bytes=shard_bytes)
    w.write_shard(samples(2))
    size = next((tmp_path / "shards").iterdir()).stat().st_size
    real = os.fsync

    def full_disk(fd):
        if "/shards/" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(StoreWriteError, match="No space left on device.*re-run `eagle-ray extract`"):
        w.write_shard(samples(2, seed=1))
    monkeypatch.setattr(os, "fsync", real)
    rep = verify_store(tmp_path)
    assert rep["ok"] and rep["samples"] == 2 and not rep["interrupted"], rep
    assert [p.stat().st_size for p in (tmp_path / "shards").iterdir()] == [size]
    assert not list((tmp_path / "index").glob(".*.tmp"))
    w.write_shard(samples(2, seed=1))  # the disk has room again: the same writer goes on
    assert verify_store(tmp_path)["samples"] == 4 == len(HiddenStateStore(tmp_path))


def test_orphan_shard_and_duplicate_rows_reported(tmp_path):
    w = StoreWriter(tmp_path, manifest())
    w.write_shard(samples(2))
    (tmp_path / "shards" / "shard-deadbeef-00000.safetensors").write_bytes(b"x")
    rep = verify_store(tmp_path)
    assert not rep["ok"] and rep["orphans"] == ["shard-deadbeef-00000.safetensors"]
    (tmp_path / "shards" / "shard-deadbeef-00000.safetensors").unlink()
    w.write_shard(samples(2))  # the same ids again, as a retried write could
    rep = verify_store(tmp_path)
    assert any("more than once" in p for p in rep["problems"])
    assert len(HiddenStateStore(tmp_path)) == 2  # readers resolve to the first commit


def test_structural_verify_names_the_damage_and_repair_is_the_way_back(tmp_path):
    from eagle_ray.store.reader import StoreDamagedError, check_store_whole
    from eagle_ray.store.repair import repair_store

    w = StoreWriter(tmp_path, manifest())
    w.write_shard(samples(2))
    w.write_shard(samples(3, seed=1))
    w.write_shard(samples(2, seed=2))
    assert check_store_whole(tmp_path)["samples"] == 7
    parts = sorted((tmp_path / "index").glob("part-*.parquet"))
    # a duplicate commit (what two concurrent extractions did), a lost index part, a temp file
    (tmp_path / "index" / "part-zzzz-00000.parquet").write_bytes(parts[0].read_bytes())
    parts[2].unlink()
    (tmp_path / "shards" / ".shard-x-00000.safetensors.tmp").write_bytes(b"partial")
    with pytest.raises(StoreDamagedError, match="more than once.*store repair") as e:
        check_store_whole(tmp_path)
    assert "orphan shard" in str(e.value)
    rep = repair_store(tmp_path)
    assert rep["duplicates_dropped"] == 2 and rep["samples"] == 5
    assert len(rep["shards_removed"]) == 1 and rep["temp_files_removed"]
    assert verify_store(tmp_path)["ok"] and len(HiddenStateStore(tmp_path)) == 5
    assert repair_store(tmp_path)["duplicates_dropped"] == 0  # idempotent


def test_repair_keeps_the_verified_copy_and_drops_corrupted_or_missing(tmp_path):
    from eagle_ray.store.repair import repair_store

    w = StoreWriter(tmp_path, manifest())
    w.write_shard(samples(3))
    w.write_shard(samples(3))  # the same ids again: a verified second copy
    w.write_shard(samples(2, seed=1))
    shards = sorted((tmp_path / "shards").iterdir())
    data = bytearray(shards[0].read_bytes())
    data[-7] ^= 0x40  # corrupts the last sample of the first copy only
    shards[0].write_bytes(bytes(data))
    shards[2].unlink()  # a missing shard: its 2 samples must be re-extracted
    rep = repair_store(tmp_path)
    assert rep["samples"] == 3 and len(rep["damaged_dropped"]) == 3, rep
    store = HiddenStateStore(tmp_path)
    assert sorted(store.sample_ids) == ["s0-0", "s0-1", "s0-2"]
    for sid in store.sample_ids:
        store.get(sid, verify=True)
    assert verify_store(tmp_path)["ok"]


def test_one_writer_per_store(tmp_path):
    from eagle_ray.store.lock import StoreBusyError, store_lock

    with store_lock(tmp_path, exclusive=True, command="eagle-ray extract"):
        with pytest.raises(StoreBusyError, match=r"in use by `eagle-ray extract` \(pid"):
            with store_lock(tmp_path, exclusive=True, command="eagle-ray extract"):
                pass
        with pytest.raises(StoreBusyError):
            with store_lock(tmp_path, exclusive=False, command="eagle-ray train"):
                pass
    with store_lock(tmp_path, exclusive=False, command="eagle-ray train"):
        with store_lock(tmp_path, exclusive=False, command="eagle-ray train"):  # readers share
            with pytest.raises(StoreBusyError, match="training run"):
                with store_lock(tmp_path, exclusive=True, command="eagle-ray store repair"):
                    pass
    with store_lock(tmp_path, exclusive=True, command="eagle-ray store repair"):
        pass  # released when the holders are done


@pytest.mark.parametrize("damage,needle", [
    ("not json", "manifest.json is not valid JSON"),
    ('{"schema_version": 1}', r"lacks required key\(s\) target_path"),
])
def test_damaged_manifest_names_the_file(tmp_path, damage, needle):
    StoreWriter(tmp_path, manifest()).write_shard(samples(1))
    (tmp_path / "manifest.json").write_text(damage)
    with pytest.raises(StoreError, match=needle):
        HiddenStateStore(tmp_path)
    with pytest.raises(StoreError, match=needle):
        StoreWriter(tmp_path, manifest())


def test_writer_of_a_superseded_run_commits_nothing(tmp_path):
    """Fencing: a writer started under one exclusive holder (a run later killed) stops
    committing once another run holds the store; the new run's writer commits."""
    from eagle_ray.store.lock import store_lock
    from eagle_ray.store.writer import StaleWriterError

    with store_lock(tmp_path, exclusive=True, command="run A"):
        old = StoreWriter(tmp_path, manifest())
        old.write_shard(samples(1, seed=1))
    with store_lock(tmp_path, exclusive=True, command="run B"):  # A died; B resumed
        new = StoreWriter(tmp_path, manifest())
        with pytest.raises(StaleWriterError):
            old.write_shard(samples(2, seed=2))
        new.write_shard(samples(1, seed=3))
    assert sorted(read_index(tmp_path).column("sample_id").to_pylist()) == ["s1-0", "s3-0"]
    rep = verify_store(tmp_path)
    assert rep["ok"] and not rep["interrupted"], rep  # no orphan shard, no temp file


def test_writer_killed_before_its_commit_leaves_an_interrupted_write_not_damage(tmp_path):
    """kill -9 of a writer between its shard and index renames (a real process, exited
    there): the store stays whole for readers and training, the leftovers are named, and the
    next exclusive writer sweeps them. A shard without even its temporary part is a lost
    index part: that stays damage."""
    import subprocess
    import sys
    import textwrap

    from eagle_ray.store.reader import StoreDamagedError, check_store_whole
    from eagle_ray.store.writer import sweep_interrupted

    StoreWriter(tmp_path, manifest()).write_shard(samples(2))
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_store import StoreWriter, manifest, samples
        real, calls = os.replace, []
        def replace(a, b):
            calls.append(b)
            if len(calls) == 2:  # the commit rename of the index part: die right before it
                os._exit(9)
            real(a, b)
        os.replace = replace
        StoreWriter({str(tmp_path)!r}, manifest()).write_shard(samples(3, seed=1))
    """)
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    assert len(list((tmp_path / "shards").glob("shard-*"))) == 2  # the shard was renamed
    rep = verify_store(tmp_path)
    assert rep["ok"] and not rep["orphans"] and len(rep["interrupted"]) == 2, rep
    assert check_store_whole(tmp_path)["samples"] == 2 == len(HiddenStateStore(tmp_path))
    assert sorted(sweep_interrupted(tmp_path)) == sorted(rep["interrupted"])
    rep = verify_store(tmp_path)
    assert rep["ok"] and not rep["interrupted"] and rep["samples"] == 2, rep
    assert len(list((tmp_path / "shards").iterdir())) == 1

    part = next((tmp_path / "index").glob("part-*.parquet"))
    part.unlink()  # a lost index part: its shard is an orphan, which no sweep may hide
    assert sweep_interrupted(tmp_path) == []
    with pytest.raises(StoreDamagedError, match="orphan shard.*store repair"):
        check_store_whole(tmp_path)
