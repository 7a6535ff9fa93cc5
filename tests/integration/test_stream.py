"""Streamed generate -> extract (one Ray Data pipeline) gives the staged commands' outputs,
and resumes per sample in both stages after a partial earlier run."""

import json

import pyarrow.parquet as pq
import pytest
import torch

from eagle_ray.config import load_recipe
from eagle_ray.data.ingest import SourceSpec, ingest
from eagle_ray.store.reader import HiddenStateStore, read_index, verify_store
from eagle_ray.tiny import corpus

pytestmark = pytest.mark.integration

N = 16
SETS = ["generate.max_tokens=24", "storage.dtype=fp32", "data.max_seq_len=96",
        "extract.batch_size=4", "generate.batch_size=4"]


def test_streamed_equals_staged_and_resumes_both_stages(tmp_path, ray_cluster, tiny_target_dir):
    from eagle_ray.extract.run import run_extract
    from eagle_ray.generate.run import run_generate
    from eagle_ray.stream import run_generate_extract

    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"messages": c}) + "\n" for c in corpus.conversations(N, seed=5)))
    ingest([SourceSpec.parse(str(tmp_path / "in.jsonl"))], tmp_path / "prompts")
    r = load_recipe("tiny_cpu", SETS)
    # Staged reference.
    run_generate(r, tmp_path / "prompts", tmp_path / "gen")
    run_extract(r, tmp_path / "gen", tmp_path / "store")
    # A partial earlier run: half the prompts generated, a quarter extracted.
    run_generate(r, tmp_path / "prompts", tmp_path / "sgen", limit=N // 2)
    run_extract(r, tmp_path / "sgen", tmp_path / "sstore", limit=N // 4)
    res = run_generate_extract(r, tmp_path / "prompts", tmp_path / "sgen", tmp_path / "sstore")
    assert (res.generated, res.extracted) == (N - N // 2, N - N // 4)
    assert res.generate_counts == {"prompts": N, "ok": N, "rejected": 0, "pending": 0}
    a = pq.read_table(tmp_path / "gen" / "conversations.parquet")
    b = pq.read_table(tmp_path / "sgen" / "conversations.parquet")
    assert a.column("sample_id").to_pylist() == b.column("sample_id").to_pylist()
    assert a.column("completion_token_ids").to_pylist() == b.column("completion_token_ids").to_pylist()
    assert not verify_store(tmp_path / "sstore")["problems"]
    ids = read_index(tmp_path / "sstore").column("sample_id").to_pylist()
    assert len(ids) == len(set(ids)) == N
    x_store, y_store = HiddenStateStore(tmp_path / "store"), HiddenStateStore(tmp_path / "sstore")
    assert sorted(x_store.sample_ids) == sorted(ids)
    for sid in ids:
        x, y = x_store.get(sid), y_store.get(sid, verify=True)
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        torch.testing.assert_close(x["aux"], y["aux"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x["final"], y["final"], atol=1e-5, rtol=1e-5)
    # Nothing left: a re-run starts no Ray work.
    again = run_generate_extract(r, tmp_path / "prompts", tmp_path / "sgen", tmp_path / "sstore")
    assert (again.generated, again.extracted) == (0, 0)
