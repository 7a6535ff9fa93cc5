"""Token counting at ingest on Ray tokenizer actors gives the same prompts.parquet, byte for
byte, as counting in the ingesting process."""

import json

from eagle_ray.data.ingest import SourceSpec, ingest
from eagle_ray.data.tokenize import length_annotator
from eagle_ray.recipes import load_recipe
from eagle_ray.targets.tiny import corpus


def test_counting_on_ray_actors_writes_the_same_prompts_file(tmp_path, ray_cluster, monkeypatch):
    from eagle_ray.data import tokenize

    monkeypatch.setattr(tokenize, "PARALLEL_CHUNK", 97)  # many batches, out of order on 2 actors
    convs = corpus.conversations(1200, seed=5)
    lines = [json.dumps({"messages": c}) for c in convs[:800]]
    lines += [json.dumps({"messages": c[:-1]}) for c in convs[800:]]  # prompts without a reference
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    recipe = load_recipe("tiny_cpu")
    ingest([SourceSpec.parse(str(tmp_path / "in.jsonl"))], tmp_path / "here",
           annotate=length_annotator(recipe, workers=1))
    ingest([SourceSpec.parse(str(tmp_path / "in.jsonl"))], tmp_path / "ray",
           annotate=length_annotator(recipe, workers=2))
    a = (tmp_path / "here" / "prompts.parquet").read_bytes()
    b = (tmp_path / "ray" / "prompts.parquet").read_bytes()
    assert a == b
    import pyarrow.parquet as pq

    t = pq.read_table(tmp_path / "here" / "prompts.parquet")
    assert t.num_rows > 1000 and "num_loss_tokens" in t.column_names
    assert sum(t.column("num_loss_tokens").to_pylist()) > 0
