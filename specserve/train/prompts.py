"""The self-distillation prompt set for the default drafter: instructions built from Python's own
documentation (the docstrings of the standard library's modules, functions and classes, read from the
source with `ast`, nothing imported; PSF License), mixed with task templates and topic lists written for
this project (Apache-2.0).

The set spans the kinds of requests a chat model gets (explaining, summarizing, listing key points,
paraphrasing, question answering over a passage, extraction, translation, code, writing, role play, math,
reasoning, general knowledge), so a drafter trained on the target's answers sees its style across tasks
rather than one domain. Spec-Bench is not used: it is the evaluation set.

    python -m specserve.train.prompts --out data/distill/prompts.jsonl --count 2400
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import random
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "ensurepip", "site-packages", "turtledemo", "tkinter",
             "distutils", "__pycache__", "pydoc_data", "config-3.11-x86_64-linux-gnu", "lib-dynload", "encodings"}
SKIP_MODULES = {"antigravity", "this", "__hello__", "__phello__"}


@dataclass(frozen=True)
class DocItem:
    """One documented object: `module.qualname` and its cleaned docstring."""

    module: str
    name: str
    kind: str  # "module", "function" or "class"
    doc: str

    @property
    def qualname(self) -> str:
        return self.module if self.kind == "module" else f"{self.module}.{self.name}"

    @property
    def first_sentence(self) -> str:
        text = " ".join(self.doc.split("\n\n")[0].split())
        match = re.match(r"(.+?[.!?])(\s|$)", text)
        return (match.group(1) if match else text).strip()


def stdlib_docs(root: str | None = None, min_chars: int = 60, max_chars: int = 900) -> list[DocItem]:
    """Docstrings of public modules, functions and classes of the standard library at `root` (default:
    this interpreter's), in a stable order; each cut to its first paragraphs within max_chars."""
    root = root or sysconfig.get_paths()["stdlib"]
    items = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for file in sorted(files):
            if not file.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, file), root)[:-3].replace(os.sep, ".")
            module = rel.removesuffix(".__init__")
            if module in SKIP_MODULES or any(part.startswith("_") for part in module.split(".")):
                continue
            try:
                with open(os.path.join(folder, file), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            nodes = [("module", module, tree)] + [
                ("class" if isinstance(n, ast.ClassDef) else "function", n.name, n) for n in tree.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not n.name.startswith("_")]
            for kind, name, node in nodes:
                doc = _clean(ast.get_docstring(node, clean=False), max_chars)
                if doc and len(doc) >= min_chars:
                    items.append(DocItem(module, name, kind, doc))
    return items


def _clean(doc: str | None, max_chars: int) -> str:
    if not doc:
        return ""
    paragraphs, size = [], 0
    for paragraph in inspect.cleandoc(doc).split("\n\n"):
        if paragraphs and size + len(paragraph) > max_chars:
            break
        paragraphs.append(paragraph.strip())
        size += len(paragraph)
    return "\n\n".join(p for p in paragraphs if p)[:max_chars].strip()


# ---------------------------------------------------------------- topics written for this project

TOPICS = [
    "photosynthesis", "the water cycle", "plate tectonics", "the French Revolution", "the printing press",
    "compound interest", "supply and demand", "the immune system", "black holes", "climate change",
    "the Roman Empire", "the theory of evolution", "vaccines", "renewable energy", "the Industrial Revolution",
    "machine learning", "the human heart", "inflation", "the Renaissance", "democracy", "gravity",
    "the internet", "DNA", "volcanoes", "the Silk Road", "electric cars", "sleep", "the moon landing",
    "recycling", "the stock market", "honey bees", "the Great Wall of China", "antibiotics",
    "public libraries", "the scientific method", "rainforests", "cryptography", "the Olympic Games",
    "coral reefs", "nuclear fission", "impressionist painting", "the Cold War", "operating systems",
    "the periodic table", "jazz", "urban gardening", "earthquakes", "the history of writing",
    "solar panels", "ancient Egypt", "probability", "the speed of light", "version control",
    "healthy eating", "the printing of money", "bridges", "tides", "the Magna Carta", "time zones",
]
ROLES = ["a museum guide", "a ship's captain", "a patient teacher", "a detective", "a chef", "a park ranger",
         "a librarian", "a medieval knight", "a travel agent", "a sports coach", "an astronaut",
         "a senior software engineer", "a customer support agent", "a journalist", "a grandparent"]
AUDIENCES = ["a ten-year-old", "a new employee", "a curious tourist", "a university student", "a busy manager",
             "a friend who has never programmed"]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
FORMS = ["a short story of about 150 words", "a poem of eight lines", "a haiku", "a persuasive paragraph",
         "a diary entry", "a product description", "a short speech", "a limerick"]
THINGS = ["apples", "books", "tickets", "bottles", "boxes", "coins", "chairs", "marbles", "pencils", "stamps"]
WORDS = ["cats", "mammals", "pets", "birds", "animals", "tools", "machines", "robots", "fruits", "plants"]


# ---------------------------------------------------------------- task families

Task = Callable[[random.Random, DocItem, list[DocItem]], str]


def _explain(r, d, _):
    return f"Explain what `{d.qualname}` does in Python and when you would use it. Its documentation says:\n\n{d.doc}"


def _summarize(r, d, _):
    return f"Summarize the following text in {r.choice(['one sentence', 'two sentences', 'a few words'])}.\n\n{d.doc}"


def _bullets(r, d, _):
    return f"List the main points of this passage as a bulleted list.\n\n{d.doc}"


def _paraphrase(r, d, _):
    return f"Rewrite the following for {r.choice(AUDIENCES)}, in plain language:\n\n{d.doc}"


def _example(r, d, _):
    return f"Write a short Python example that uses `{d.qualname}`, with a comment on each step."


def _implement(r, d, _):
    return f"Write a Python function that does the following, with a docstring and a usage example: {d.first_sentence}"


def _qa(r, d, _):
    question = r.choice([f"What does `{d.name}` do?", "What inputs does it take, and what does it return?",
                         "What could go wrong when using it?", "Give one situation where it is useful."])
    return f"Answer the question using only the documentation below.\n\nDocumentation:\n{d.doc}\n\nQuestion: {question}"


def _extract(r, d, _):
    what = r.choice(["every parameter or identifier name", "every verb", "the nouns that name data types",
                     "each action the text describes"])
    return f"Extract {what} mentioned in the text below and return them as a JSON list.\n\n{d.doc}"


def _translate(r, d, _):
    return f"Translate into {r.choice(LANGUAGES)}:\n\n{d.first_sentence}"


def _compare(r, d, items):
    other = r.choice([i for i in items if i.module == d.module and i.name != d.name] or items)
    return (f"What is the difference between `{d.qualname}` and `{other.qualname}` in Python? Give an example of "
            f"each.")


def _write(r, d, _):
    subject = r.choice([r.choice(TOPICS), f"a programmer learning the `{d.module}` module"])
    return f"Write {r.choice(FORMS)} about {subject}."


def _roleplay(r, d, _):
    return f"You are {r.choice(ROLES)}. Stay in character and explain {r.choice(TOPICS)} to {r.choice(AUDIENCES)}."


def _knowledge(r, d, _):
    topic = r.choice(TOPICS)
    return r.choice([f"Explain {topic} in simple terms.", f"What are three common misconceptions about {topic}?",
                     f"Give a short history of {topic}.", f"Why does {topic} matter today?",
                     f"Write five quiz questions about {topic}, with answers."])


def _math(r, d, _):
    a, b, c = r.randint(2, 90), r.randint(2, 40), r.randint(1, 500)
    thing = r.choice(THINGS)
    return r.choice([
        f"A shop sells {a} {thing} each day for {b} days and then receives {c} more. How many {thing} did it "
        f"handle in total? Show your reasoning step by step.",
        f"What is {a} * {b} + {c}? Explain each step.",
        f"Solve for x: {a}x + {b} = {c + a * b}. Show your work.",
        f"A list holds {b} numbers whose average is {a}. One number, {c}, is added. What is the new average?",
        f"A train travels {a * 10} km in {b} hours. What is its average speed, and how far does it go in {c} "
        f"minutes at that speed?",
        f"If a loop runs {a} times and each pass appends {b} items to a list that starts with {c} items, how "
        f"long is the list at the end?"])


def _reasoning(r, d, _):
    x, y, z = r.sample(WORDS, 3)
    return r.choice([
        f"If every {x[:-1]} is a {y[:-1]} and some {y} are {z}, must some {x} be {z}? Explain your reasoning.",
        "Alice is older than Bob, and Bob is older than Carol. Who is the youngest? Explain.",
        f"A box has {r.randint(2, 9)} red and {r.randint(2, 9)} blue balls. What is the probability of drawing "
        f"two red balls without replacement? Reason step by step.",
        f"Is this statement true or false, and why? \"{d.first_sentence}\" describes `{d.qualname}`."])


TASKS: list[tuple[Task, float]] = [
    (_explain, 2), (_summarize, 2), (_bullets, 1), (_paraphrase, 1), (_example, 2), (_implement, 2), (_qa, 2),
    (_extract, 1), (_translate, 1), (_compare, 1), (_write, 1.5), (_roleplay, 1), (_knowledge, 1.5),
    (_math, 1.5), (_reasoning, 1)]


def build_prompts(count: int, seed: int = 0, root: str | None = None) -> list[dict]:
    """count prompts [{"id", "task", "source", "prompt"}], deterministic for a seed and stdlib tree."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    items = stdlib_docs(root)
    if not items:
        raise ValueError(f"no docstrings found under {root or sysconfig.get_paths()['stdlib']}")
    r = random.Random(seed)
    tasks, weights = zip(*TASKS)
    out, seen = [], set()
    while len(out) < count:
        task, item = r.choices(tasks, weights)[0], r.choice(items)
        prompt = task(r, item, items)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"id": len(out), "task": task.__name__.lstrip("_"), "source": item.qualname, "prompt": prompt})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--count", type=int, default=2400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stdlib", default=None, help="standard library folder (default: this interpreter's)")
    args = p.parse_args(argv)
    rows = build_prompts(args.count, args.seed, args.stdlib)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{len(rows)} prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
