"""Several completions per prompt: stable ids, one batch per prompt's completions, duplicates
kept once, and every split by prompt."""

from eagle_ray.data.ids import completion_id, prompt_id, sample_seed, turn_completion_id, turn_index
from eagle_ray.generate.stage import _drop_duplicate_completions, rejected
from eagle_ray.train.data import split_ids


def test_ids_and_seeds_are_stable():
    assert completion_id("ab12", 0, 1) == "ab12"  # one completion: the prompt's own id
    ids = [completion_id("ab12", j, 4) for j in range(4)]
    assert ids == ["ab12#0", "ab12#1", "ab12#2", "ab12#3"]
    assert {prompt_id(i) for i in ids} == {"ab12"} and prompt_id("ab12") == "ab12"
    seeds = [sample_seed(0, i) for i in ids]
    assert len(set(seeds)) == 4 and seeds == [sample_seed(0, i) for i in ids]
    assert sample_seed(1, ids[0]) != seeds[0]


def test_identical_completions_of_a_prompt_are_kept_once():
    def ok(sid, toks):
        return {"sample_id": sid, "source": "s", "status": "ok", "completion_token_ids": toks}

    rows = [ok("p#0", [1, 2]), ok("p#1", [1, 2]), ok("p#2", [3]), ok("q#0", [1, 2]),
            rejected("p#3", "s", "prompt_too_long", "x")]
    _drop_duplicate_completions(rows, 4)
    assert [r["status"] for r in rows] == ["ok", "rejected", "ok", "ok", "rejected"]
    assert rows[1]["reason"] == "duplicate_completion" and "p#0" in rows[1]["message"]
    assert rows[4]["reason"] == "prompt_too_long"


def test_identical_completions_of_different_turns_are_both_kept():
    """Every turn regenerated (ids `<p>#<t * N + j>`): the same tokens at two turns of one
    session are two samples (two histories); within a turn, one."""
    def ok(sid, toks):
        return {"sample_id": sid, "source": "s", "status": "ok", "completion_token_ids": toks}

    ids = [turn_completion_id("p", t, j, 2) for t in range(2) for j in range(2)]
    assert ids == ["p#0", "p#1", "p#2", "p#3"]
    assert [turn_index(i, 2) for i in ids] == [0, 0, 1, 1] and {prompt_id(i) for i in ids} == {"p"}
    rows = [ok(i, [7]) for i in ids]
    _drop_duplicate_completions(rows, 2)
    assert [r["status"] for r in rows] == ["ok", "rejected", "ok", "rejected"]


def test_split_is_by_prompt():
    ids = [f"{p:04x}#{j}" for p in range(400) for j in range(4)]
    train, val = split_ids(ids, 0.2)
    assert val and train
    assert not {prompt_id(s) for s in train} & {prompt_id(s) for s in val}
    # one completion per prompt: the same split as before (ids are prompt ids)
    t1, v1 = split_ids([f"{p:04x}" for p in range(400)], 0.2)
    assert {prompt_id(s) for s in val} == set(v1)
