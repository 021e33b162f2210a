"""The default model's training text: the interpreter's own documentation.

`pydoc_data.topics` ships with every CPython (the text behind `help("assert")`,
about 450 KB of English about Python). Every tenth topic is held out for
measuring perplexity; the rest become plain documents plus chat turns built
from them, so that the model also learns the chat template's shape: answers
that end with an end-of-turn token, short JSON answers and a function call
when the system turn offers one.
"""

from __future__ import annotations

import json
import pydoc_data.topics
import random
import re

HELD_OUT_EVERY = 10  # topic i (sorted by name) is held out when i % 10 == 9
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup_topic",
        "description": "Look a topic up in the Python documentation.",
        "parameters": {
            "type": "object",
            "properties": {"topic": {"type": "string"}},
            "required": ["topic"],
        },
    },
}
_QUESTIONS = (
    "What is {title}?",
    "Tell me about {title}.",
    "Explain {name} in Python.",
    "How does {name} work?",
    "Describe {title}.",
)


def topics() -> dict[str, str]:
    return dict(sorted(pydoc_data.topics.topics.items()))


def split_topics() -> tuple[list[str], list[str]]:
    """(training topic names, held-out topic names)."""
    names = list(topics())
    held = [n for i, n in enumerate(names) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    return [n for n in names if n not in held], held


def held_out_text(names: list[str] | None = None) -> str:
    """The held-out topics' text (those of this interpreter's pydoc_data that exist)."""
    all_topics = topics()
    names = split_topics()[1] if names is None else names
    return "\n\n".join(all_topics[n] for n in names if n in all_topics)


def _title(text: str, name: str) -> str:
    first = text.strip().splitlines()[0].strip()
    return first if 3 < len(first) < 80 else name.replace("-", " ")


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs (no headings, code, grammar rules or tables), joined into lines."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if not lines or any(line.startswith((" ", "\t")) for line in lines):
            continue
        if set(lines[-1].strip()) <= set("*=-+|"):
            continue  # a heading and its underline
        joined = " ".join(line.strip() for line in lines)
        if len(joined) > 60 and joined[-1] in ".:)":
            out.append(joined)
    return out


def _answer(paragraphs: list[str], limit: int) -> str:
    text = ""
    for p in paragraphs:
        if text and len(text) + len(p) > limit:
            break
        text = f"{text}\n\n{p}" if text else p
    if len(text) > limit:  # one long paragraph: cut at a sentence end
        cut = text.rfind(". ", 0, limit)
        text = text[: cut + 1] if cut > 0 else text[:limit]
    return text


def _first_sentence(paragraph: str) -> str:
    end = paragraph.find(". ")
    return paragraph[: end + 1] if 0 < end < 200 else paragraph[:200]


def chat_samples(names: list[str], seed: int = 0) -> list[list[dict]]:
    """Conversations about the given topics, each a list of chat messages."""
    rng = random.Random(seed)
    all_topics = topics()
    samples = []
    for name in names:
        text = all_topics[name]
        paragraphs = _paragraphs(text)
        if not paragraphs:
            continue
        title = _title(text, name)
        subject = {"title": title, "name": name.replace("-", " ")}
        for question in rng.sample(_QUESTIONS, 3):
            answer = _answer(paragraphs, rng.choice((300, 600, 900)))
            samples.append(
                [
                    {"role": "user", "content": question.format(**subject)},
                    {"role": "assistant", "content": answer},
                ]
            )
        summary = json.dumps({"topic": name, "summary": _first_sentence(paragraphs[0])})
        samples.append(
            [
                {"role": "user", "content": f"Describe {subject['name']} as JSON."},
                {"role": "assistant", "content": summary},
            ]
        )
        call = {"function": {"name": "lookup_topic", "arguments": {"topic": name}}}
        samples.append(
            [
                {"role": "user", "content": f"Look up {subject['name']} in the documentation."},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": _first_sentence(paragraphs[0])},
                {"role": "assistant", "content": _answer(paragraphs, 300)},
            ]
        )
    return samples


def tool_sample_marker(messages: list[dict]) -> bool:
    """Whether a conversation calls a function (it is rendered with the tools)."""
    return any(m.get("tool_calls") for m in messages)
