"""Requests about a document, for self-synthesized chat data (`specserve synthesize-data --documents-from`):
summarize a text, list or extract from it, rewrite or translate it, title or critique or continue it, or
answer a question about it that the target writes itself. The documents are the target's own finished
answers from earlier shards (passages_of) or standard-library docstrings; each is used once (passage_key)."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

from specserve.train.prompts import AUDIENCES, LANGUAGES
from specserve.train.shards import Conversation, answer_spans
from specserve.train.text_filters import degenerate_reason

# Requests about a document (written for this project, Apache-2.0): kind -> instructions; {n}, {what},
# {audience} and {lang} are filled at random. "question" is written by the target itself (document_turn).
DOCUMENT_TASKS = {
    "summarize": ("Summarize the following text.", "Summarize this in {n} sentences.",
                  "Write a short summary of the text below.", "Give me a TL;DR of this:",
                  "What is the main idea of this text? Answer in one paragraph."),
    "key points": ("List the key points of the text below.", "What are the main takeaways? Use bullet points.",
                   "Outline this text as a numbered list."),
    "extract": ("Extract all the {what} mentioned in the text below.",
                "From the text below, extract the {what} and return them as a JSON list.",
                "Make a table of the {what} in this text."),
    "rewrite": ("Rewrite this text for {audience}.", "Make the following text more formal.",
                "Make the following text shorter without losing anything important.",
                "Paraphrase this text in your own words.", "Improve the style and grammar of this text."),
    "translate": ("Translate the following text into {lang}.", "Translate this into {lang}:"),
    "title": ("Suggest a title for this text.", "Write a headline and a one-sentence subtitle for this text."),
    "critique": ("What is the tone of this text? Explain with examples from it.",
                 "Is anything in this text unclear or inaccurate? Explain.",
                 "Write three questions a reader might ask after reading this, and answer them."),
    "continue": ("Continue this text with another paragraph in the same style.",),
    "question": ("Answer my question using the text below.", "Read this text, then answer the question after it."),
}
DOCUMENT_WEIGHTS = {"summarize": 3, "key points": 2, "extract": 2, "rewrite": 2, "translate": 1, "title": 1,
                    "critique": 1, "continue": 1, "question": 4}
EXTRACT_WHAT = ("names", "numbers", "steps", "recommendations", "technical terms", "places", "dates",
                "main claims", "examples")


def document_turn(rng: np.random.Generator, passage: str) -> tuple[str, str, bool]:
    """A request about passage: (kind, text, asks). The instruction comes before or after the passage; for
    kind "question" the text ends where the user's question starts (asks: the target writes the question)."""
    kinds = list(DOCUMENT_WEIGHTS)
    weights = np.array([DOCUMENT_WEIGHTS[k] for k in kinds], float)
    kind = kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]
    instruction = str(rng.choice(DOCUMENT_TASKS[kind])).format(
        n=int(rng.integers(2, 5)), what=rng.choice(EXTRACT_WHAT), audience=rng.choice(AUDIENCES),
        lang=rng.choice(LANGUAGES))
    if kind == "question":
        return kind, f"{instruction}\n\n{passage}\n\nQuestion:", True
    layout = int(rng.integers(3))
    if layout == 0:
        return kind, f"{instruction}\n\n{passage}", False
    if layout == 1:
        return kind, f"{passage}\n\n{instruction.replace('below', 'above')}", False
    return kind, f'{instruction}\n\nText:\n"""\n{passage}\n"""', False


def passages_of(tokenizer, convs: Iterable[Conversation], passage_tokens: tuple[int, int]) -> list[str]:
    """The finished answers of convs (finish "stop") of passage_tokens (lo, hi) tokens, as text: documents for
    later shards' requests."""
    lo, hi = passage_tokens
    out = []
    for conv in convs:
        for (a, b), finish in zip(answer_spans(conv.assistant), conv.meta["finish"]):
            if finish == "stop" and lo <= b - a <= hi:
                text = tokenizer.decode(conv.token_ids[a:b].tolist(), skip_special_tokens=True).strip()
                if degenerate_reason(text, max_words=2 * hi, max_chars=8 * hi) is None:
                    out.append(text)
    return out


def passage_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
