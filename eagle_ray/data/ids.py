"""Sample ids: a prompt's id (ingest: a content hash) and the ids of its completions.

    prompt id            "3f9c…"           (ingest; hex, never holds the separator)
    completion j of N    "3f9c…#j"         (generate.samples_per_prompt = N > 1)
    the only completion  "3f9c…"           (N = 1: the prompt's own id, as before)
    turn t, completion j "3f9c…#k"         (data.train_turns=all regenerating: every assistant
                                            turn of the session, k = t * N + j, always with "#")

The number after the separator orders a prompt's samples (turn, then completion); nothing
assumes how many a prompt has: a session has as many turns as its log.

Everything that must not leak between training and evaluation (the train/validation split,
evaluate's held-out prompts) works on prompt ids, so every completion of a held-out prompt
stays held out.
"""

from __future__ import annotations

import hashlib

SEP = "#"


def completion_id(prompt_id: str, j: int, n: int) -> str:
    return prompt_id if n == 1 else f"{prompt_id}{SEP}{j}"


def turn_completion_id(prompt_id: str, turn: int, j: int, n: int) -> str:
    """Completion j of N of assistant turn `turn` (regenerating every turn of a session)."""
    return f"{prompt_id}{SEP}{turn * n + j}"


def turn_index(sample_id: str, n: int) -> int:
    """The turn of a `turn_completion_id` (0 for ids without turns)."""
    return completion_index(sample_id) // n


def prompt_id(sample_id: str) -> str:
    return sample_id.split(SEP, 1)[0]


def completion_index(sample_id: str) -> int:
    """j of `<prompt>#<j>`; 0 for a prompt's only completion."""
    _, sep, j = sample_id.partition(SEP)
    return int(j) if sep else 0


def sample_seed(seed: int, sample_id: str) -> int:
    """The per-sample sampling seed: the same completion whatever batch or replica draws it."""
    h = hashlib.blake2b(f"{seed}:{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF
