"""The distillation prompt builder: docstrings read from source without importing it, every task family
used, deterministic for a seed, no duplicates; the distillation reader's errors name the line."""
import json

import pytest

from specserve.train.distill import read_prompts
from specserve.train.prompts import TASKS, build_prompts, stdlib_docs

MODULE = '''"""A tiny module for tests: it frobnicates widgets and counts the gadgets that come back."""
raise SystemExit("importing this module is a bug")


def frob(widget, times=1):
    """Frobnicate a widget a number of times and return the frobnicated widget to the caller."""


def _hidden():
    """A private helper that must never show up in the prompt set, whatever it says here."""


class Gadget:
    """A gadget that remembers how often it was frobnicated, and can reset that count to zero."""
'''


@pytest.fixture
def root(tmp_path):
    (tmp_path / "widgets.py").write_text(MODULE)
    (tmp_path / "_private.py").write_text(MODULE)
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "skipped.py").write_text(MODULE)
    return str(tmp_path)


def test_docstrings_come_from_the_source_public_names_only(root):
    items = stdlib_docs(root)
    assert sorted(i.qualname for i in items) == ["widgets", "widgets.Gadget", "widgets.frob"]
    assert next(i for i in items if i.name == "frob").first_sentence.startswith("Frobnicate a widget")


def test_prompts_are_deterministic_distinct_and_cover_every_task(root):
    rows = build_prompts(300, seed=3, root=root)
    assert rows == build_prompts(300, seed=3, root=root)
    assert rows != build_prompts(300, seed=4, root=root)
    assert len({r["prompt"] for r in rows}) == 300 and [r["id"] for r in rows] == list(range(300))
    assert {r["task"] for r in rows} == {t.__name__.lstrip("_") for t, _ in TASKS}
    with pytest.raises(ValueError, match="count"):
        build_prompts(0, root=root)


def test_read_prompts_accepts_prompts_messages_and_text(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n\n" + json.dumps({"id": 7, "messages": [
        {"role": "user", "content": "yo"}]}) + "\n")
    assert read_prompts(str(path)) == [{"id": 0, "messages": [{"role": "user", "content": "hi"}]},
                                       {"id": 7, "messages": [{"role": "user", "content": "yo"}]}]
    text = tmp_path / "p.txt"
    text.write_text("one\ntwo\n")
    assert [r["messages"][0]["content"] for r in read_prompts(str(text))] == ["one", "two"]
    path.write_text(json.dumps({"text": "no prompt"}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: each row needs a string \"prompt\""):
        read_prompts(str(path))
    path.write_text("{broken\n")
    with pytest.raises(ValueError, match="p.jsonl:1: not valid JSON"):
        read_prompts(str(path))
