"""The demo's printed sample: the last user message and the target's regenerated answer,
whitespace folded and cut; nothing when the run has no conversations."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_ray.job.demo import example_text


def test_one_regenerated_sample_is_printed_as_text(tmp_path):
    assert example_text(tmp_path) == ""
    (tmp_path / "generate").mkdir()
    msgs = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "logged"},
            {"role": "user", "content": [{"type": "text", "text": "and   then?"}]}]
    pq.write_table(pa.Table.from_pylist([
        {"status": "rejected", "messages": json.dumps(msgs), "completion_text": None},
        {"status": "ok", "messages": json.dumps(msgs), "completion_text": "x" * 50 + "\n\nend"}]),
        tmp_path / "generate" / "conversations.parquet")
    text = example_text(tmp_path, width=40)
    assert "user:   and then?" in text
    assert "target: " + "x" * 40 + " ..." in text
