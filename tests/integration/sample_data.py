"""The bundled sample data, fewer of each (CI time): the same two labelled sources. The tiny
target's drafters saturate at an eighth of the full set (`eagle-ray curve` on the demo).
And the settings of the trained tiny run several test files share (conftest.tiny_trained)."""

from eagle_ray.job.pipeline import SAMPLE_DATA


def small_sample_data(personal: int = 200, general: int = 150) -> list[str]:
    mine, theirs = SAMPLE_DATA[0], SAMPLE_DATA[1].split(":")[0]
    return [f"{mine}:{personal}", f"{theirs}:{general}::general"]


# conftest.tiny_trained: logged responses (no generation), HF extraction, 256-token windows,
# trained for TINY_STEPS (held-out step-0 accuracy ~0.9 by then: the demo's curve flattens
# after ~80 steps; test_train and test_export_evaluate keep their quality floors on it).
TINY_STEPS = 80
TINY_TRAINED = ["generate.mode=keep_logged", "extract.backend=hf", "extract.num_cpus_per_replica=1",
                "data.max_seq_len=256", "train.cpus_per_worker=1", "train.log_interval=10"]


def sharegpt_short(path, out, n: int, max_chars: int = 300) -> int:
    """The first `n` conversations of the shipped ShareGPT V3 file (streamed with ingest's
    own reader) whose opening turn is a human's of at most `max_chars` characters, written as
    JSONL to `out`, one exchange each (the prompt is the history up to the last human turn):
    short prompts, so the real target's generation fits CI's time."""
    import json

    from eagle_ray.data.json_array import ArrayReader, Record

    kept = 0
    with open(path, "rb") as f, open(out, "w") as w:
        for rec in ArrayReader(f):
            if not isinstance(rec, Record):
                break
            turns = rec.obj.get("conversations") or []
            if (len(turns) == 2 and turns[0].get("from") == "human"
                    and 0 < len(turns[0].get("value") or "") <= max_chars):
                w.write(json.dumps(rec.obj, ensure_ascii=False) + "\n")
                kept += 1
                if kept == n:
                    break
    return kept
