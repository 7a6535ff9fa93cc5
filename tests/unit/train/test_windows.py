"""Online training's windows (extract/stage.Windows): what `window` cuts for each ok
conversation, built on demand from Arrow buffers, with the lookups of the dict it replaces."""

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_ray.extract.stage import read_windows, window


def test_windows_equal_the_window_of_each_ok_conversation(tmp_path):
    rows = [("a", "ok", [1, 2, 3], [4, 5]), ("b", "rejected", [1], []), ("c", "ok", [7] * 9, [8] * 4),
            ("d", "ok", [], [9, 9]), ("a2", "ok", [3], [])]
    t = pa.table({"sample_id": [r[0] for r in rows], "status": [r[1] for r in rows],
                  "prompt_token_ids": pa.array([r[2] for r in rows], pa.list_(pa.int32())),
                  "completion_token_ids": pa.array([r[3] for r in rows], pa.list_(pa.int32()))})
    pq.write_table(t, tmp_path / "conversations.parquet", row_group_size=2)  # several chunks
    w = read_windows(tmp_path, max_seq_len=10)
    want = {}
    for sid, status, p, c in rows:
        if status == "ok":
            ids, mask, n = window(p, c, 10)
            want[sid] = (ids.tolist(), mask.tolist(), n)
    assert dict(w) == want and list(w) == list(want) and len(w) == 4
    assert "b" not in w and "c" in w
    assert w["c"] == ([7] * 9 + [8], [False] * 9 + [True], 13)
    assert all(w.length(s) == len(want[s][0]) for s in want)
    assert type(w["a"][0][0]) is int and type(w["a"][1][0]) is bool
