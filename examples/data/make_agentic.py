"""Writes examples/data/agentic.jsonl: agent sessions as a serving gateway exports them.

Deterministic (seeded); rerun after editing: python examples/data/make_agentic.py

Each line is one OpenAI chat-completions record (a request's ``messages`` + ``tools``, with
the final assistant answer appended), in the shapes real gateway logs have: assistant
``tool_calls`` with ``content: null``, ``tool`` results as strings or text parts, reasoning
on tool-call turns (``reasoning_content``, or ``reasoning`` as some gateways name it),
parallel calls, the legacy ``functions`` / ``function_call`` / ``function`` role, glaive-style
ShareGPT records with a ``tools`` string, long sessions, an image part, and one broken record
of each kind ingest must reject by name. The vocabulary is the tiny targets' (animals,
places), so the tiny targets read it as they read their corpus.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ANIMALS = ["fox", "lynx", "duck", "dog", "cat", "owl", "bear", "wolf", "deer", "hare"]
PLACES = ["river", "forest", "island", "valley", "village", "garden", "mountain", "lake"]

TOOLS = [
    {"type": "function", "function": {
        "name": "find_animals", "description": "List the animals that live in a place.",
        "parameters": {"type": "object", "properties": {
            "place": {"type": "string", "description": "The place to search."},
            "limit": {"type": "integer", "description": "At most this many animals."}},
            "required": ["place"]}}},
    {"type": "function", "function": {
        "name": "describe_animal", "description": "A short description of one animal.",
        "parameters": {"type": "object", "properties": {
            "animal": {"type": "string"}}, "required": ["animal"]}}},
    {"type": "function", "function": {
        "name": "weather", "description": "Today's weather in a place.",
        "parameters": {"type": "object", "properties": {
            "place": {"type": "string"}}, "required": ["place"]}}},
]


def call(name: str, args: dict, cid: str) -> dict:
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def session(rng: random.Random, i: int, *, turns: int = 1, parallel: bool = False,
            reasoning_key: str = "reasoning_content", parts: bool = False) -> dict:
    """A system prompt, then `turns` rounds of user -> calls -> results -> answer."""
    msgs: list[dict] = [{"role": "system", "content": "You are a helpful guide to animals and places."}]
    k = 0
    for t in range(turns):
        place = rng.choice(PLACES)
        msgs.append({"role": "user", "content": f"Which animals live in the {place}?"})
        calls = [call("find_animals", {"place": place, "limit": 3}, f"call_{i}_{k}")]
        k += 1
        if parallel:
            calls.append(call("weather", {"place": place}, f"call_{i}_{k}"))
            k += 1
        msgs.append({"role": "assistant", "content": None, "tool_calls": calls,
                     reasoning_key: f"I should look up the animals of the {place} first."})
        found = rng.sample(ANIMALS, 3)
        for c in calls:
            name = c["function"]["name"]
            result = (json.dumps({"animals": found}) if name == "find_animals"
                      else json.dumps({"sky": rng.choice(["sunny", "rainy"])}))
            content = [{"type": "text", "text": result}] if parts else result
            msgs.append({"role": "tool", "tool_call_id": c["id"], "content": content})
        msgs.append({"role": "assistant",
                     "content": f"In the {place} you can find the {found[0]}, the {found[1]} "
                                f"and the {found[2]}."})
    return {"messages": msgs, "tools": TOOLS}


def legacy(rng: random.Random) -> dict:
    animal = rng.choice(ANIMALS)
    return {"functions": [t["function"] for t in TOOLS[1:2]], "messages": [
        {"role": "user", "content": f"Describe the {animal}."},
        {"role": "assistant", "content": None,
         "function_call": {"name": "describe_animal", "arguments": json.dumps({"animal": animal})}},
        {"role": "function", "name": "describe_animal", "content": f"The {animal} is quick."},
        {"role": "assistant", "content": f"The {animal} is a quick animal."}]}


def glaive(rng: random.Random) -> dict:
    place = rng.choice(PLACES)
    found = rng.sample(ANIMALS, 2)
    return {"tools": json.dumps(TOOLS[:1]), "conversations": [
        {"from": "human", "value": f"What lives in the {place}?"},
        {"from": "function_call", "value": json.dumps({"name": "find_animals",
                                                       "arguments": {"place": place}})},
        {"from": "observation", "value": json.dumps({"animals": found})},
        {"from": "gpt", "value": f"The {found[0]} and the {found[1]} live in the {place}."}]}


def text_only(rng: random.Random) -> dict:
    """A plain chat turn in a session that offers tools: the model answers without a call."""
    animal = rng.choice(ANIMALS)
    return {"tools": TOOLS, "messages": [
        {"role": "user", "content": f"Tell me a story about a {animal}."},
        {"role": "assistant", "content": f"One evening, a {animal} walked to the river. The end."}]}


def broken() -> list[dict]:
    """One record per reject kind ingest names (the reason code in `_expect`)."""
    u = {"role": "user", "content": "Which animals live in the lake?"}
    a_call = {"role": "assistant", "content": None,
              "tool_calls": [call("find_animals", {"place": "lake"}, "call_x")]}
    return [
        {"_expect": "bad_tools", "tools": "find_animals", "messages": [u, {"role": "assistant", "content": "ok"}]},
        {"_expect": "bad_arguments", "tools": TOOLS, "messages": [
            u, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "find_animals",
                                                              "arguments": "{place: lake"}}]}]},
        {"_expect": "orphan_tool_result", "tools": TOOLS, "messages": [
            u, a_call, {"role": "tool", "tool_call_id": "call_nope", "content": "{}"}]},
        {"_expect": "missing_tool_result", "tools": TOOLS, "messages": [
            u, a_call, {"role": "user", "content": "Hello?"}]},
        {"_expect": "bad_tool_call", "tools": TOOLS, "messages": [
            u, {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}]},
        {"_expect": "non_text_part", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What animal is this?"},
                                         {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
            {"role": "assistant", "content": "A fox."}]},
    ]


def main() -> None:
    rng = random.Random(0)
    rows = []
    for i in range(24):
        rows.append(session(rng, i, turns=1 + i % 3, parallel=i % 4 == 1,
                            reasoning_key="reasoning" if i % 5 == 2 else "reasoning_content",
                            parts=i % 6 == 3))
    rows += [session(rng, 100 + j, turns=12) for j in range(2)]  # long sessions (~75 messages)
    rows += [legacy(rng) for _ in range(4)] + [glaive(rng) for _ in range(4)]
    rows += [text_only(rng) for _ in range(4)]
    rows += broken()
    out = Path(__file__).with_name("agentic.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} records to {out}")


if __name__ == "__main__":
    main()
