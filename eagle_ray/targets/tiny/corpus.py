"""The text the project ships for the tiny target: seeded synthetic conversations.

No model or data set can be downloaded here, so the tiny target's tokenizer and its brief
training run use conversations generated from the small lexicon below. The language is
regular enough that a 1.6M-parameter model learns it in seconds (so greedy output is not
degenerate and a drafter has something real to learn), and varied enough that outputs
differ across prompts. Reasoning turns carry a `reasoning_content` so the `<think>` path of
the chat template is exercised.
"""

from __future__ import annotations

import random

ANIMALS = ["fox", "owl", "cat", "dog", "bear", "wolf", "deer", "hare", "duck", "frog",
           "mole", "seal", "crow", "goat", "lynx", "swan"]
PLACES = ["forest", "river", "meadow", "mountain", "lake", "garden", "village", "desert",
          "island", "valley"]
FOODS = ["berries", "fish", "seeds", "insects", "grass", "roots", "apples", "nuts", "mice",
         "leaves"]
COLORS = ["red", "brown", "grey", "white", "black", "golden", "green", "blue"]
TIMES = ["morning", "evening", "night", "winter", "summer", "spring", "autumn"]
VERBS = ["sleeps", "hunts", "sings", "swims", "runs", "waits", "plays", "hides"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve"]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a friendly guide to nature.",
                  "Answer briefly and clearly."]


def _animal_facts(rng: random.Random, animal: str) -> list[str]:
    place, food, color = rng.choice(PLACES), rng.choice(FOODS), rng.choice(COLORS)
    time, verb = rng.choice(TIMES), rng.choice(VERBS)
    return [
        f"The {animal} lives in the {place}.",
        f"It eats {food} and it {verb} in the {time}.",
        f"Its coat is {color}.",
    ]


def _qa_animal(rng: random.Random) -> tuple[str, str, str | None]:
    animal = rng.choice(ANIMALS)
    question = rng.choice([f"Tell me about the {animal}.", f"What do you know about the {animal}?",
                           f"Describe the {animal}."])
    facts = _animal_facts(rng, animal)
    return question, " ".join(facts), None


def _qa_arith(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(0, 6), rng.randint(0, 6)
    op = rng.choice(["plus", "times"])
    result = a + b if op == "plus" else a * b
    question = rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}."])
    reasoning = (f"I need {a} {op} {b}. "
                 + (f"Adding {b} to {a} gives {result}." if op == "plus"
                    else f"{a} groups of {b} make {result}."))
    answer = f"The answer is {result}."
    if result < len(NUMBER_WORDS):
        answer += f" In words, that is {NUMBER_WORDS[result]}."
    return question, answer, reasoning


def _qa_story(rng: random.Random) -> tuple[str, str, str | None]:
    a1, a2 = rng.sample(ANIMALS, 2)
    place, time = rng.choice(PLACES), rng.choice(TIMES)
    question = rng.choice([f"Tell me a story about a {a1} and a {a2}.",
                           f"Write a short story with a {a1}."])
    story = (f"One {time}, a {a1} walked to the {place}. There it met a {a2}. "
             f"The {a2} said hello, and the {a1} smiled. They played until the {rng.choice(TIMES)}. "
             "The end.")
    reasoning = f"A short story: a {a1} meets a {a2} in the {place}." if rng.random() < 0.5 else None
    return question, story, reasoning


def _qa_list(rng: random.Random) -> tuple[str, str, str | None]:
    place = rng.choice(PLACES)
    animals = rng.sample(ANIMALS, 3)
    question = f"Which animals live in the {place}?"
    answer = (f"In the {place} you can find the {animals[0]}, the {animals[1]} and the {animals[2]}. "
              f"The {animals[0]} is the most common.")
    return question, answer, None


GENERATORS = (_qa_animal, _qa_arith, _qa_story, _qa_list)


def conversation(rng: random.Random, *, max_turns: int = 2) -> list[dict[str, str]]:
    """One OpenAI-style conversation: optional system, 1..max_turns user/assistant pairs."""
    messages: list[dict[str, str]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(rng.randint(1, max_turns)):
        question, answer, reasoning = rng.choice(GENERATORS)(rng)
        messages.append({"role": "user", "content": question})
        turn = {"role": "assistant", "content": answer}
        if reasoning:
            turn["reasoning_content"] = reasoning
        messages.append(turn)
    return messages


def conversations(n: int, seed: int = 0, *, max_turns: int = 2) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    return [conversation(rng, max_turns=max_turns) for _ in range(n)]


def plain_text(n: int, seed: int = 0) -> list[str]:
    """Plain sentences (tokenizer training text beside the chat turns)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        question, answer, reasoning = rng.choice(GENERATORS)(rng)
        out.append(" ".join(x for x in (question, reasoning, answer) if x))
    return out
