"""Regenerate the bundled sample data set (examples/data/*.jsonl) deterministically.

personal.jsonl: "the user's traffic" in OpenAI messages format (reasoning included), with a
few realistic bad lines so the demo shows rejects. general_sharegpt.jsonl: a general set in
ShareGPT format. Run: python scripts/make_sample_data.py
"""

import json
import random
from pathlib import Path

from eagle_ray.targets.tiny import corpus

OUT = Path(__file__).resolve().parent.parent / "examples" / "data"


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    personal = [json.dumps({"messages": c}) for c in corpus.conversations(300, seed=101, max_turns=3)]
    personal.insert(17, '{"messages": [{"role": "user", "content": "unterminated')
    personal.insert(42, json.dumps({"messages": [{"role": "robot", "content": "beep"}]}))
    personal.insert(77, json.dumps({"messages": [{"role": "user", "content": "   "}]}))
    personal.insert(120, personal[5])  # an exact duplicate
    (OUT / "personal.jsonl").write_text("\n".join(personal) + "\n")

    rng = random.Random(202)
    general = []
    for c in corpus.conversations(1200, seed=202, max_turns=2):
        role_map = {"system": "system", "user": "human", "assistant": "gpt"}
        general.append(json.dumps({"id": f"g{len(general)}", "conversations": [
            {"from": role_map[m["role"]], "value": m["content"]} for m in c]}))
    rng.shuffle(general)
    (OUT / "general_sharegpt.jsonl").write_text("\n".join(general) + "\n")


if __name__ == "__main__":
    main()
