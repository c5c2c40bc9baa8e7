"""Filters of synthesized user turns: degenerate text, near duplicates and evaluation overlap against brute
force, and rejection counts by reason."""
from __future__ import annotations

import random

import pytest

from specserve.train.text_filters import (Filters, NearDuplicates, OverlapGuard, degenerate_reason, specbench_texts,
                                          word_ngrams, words)


@pytest.mark.parametrize("text, reason", [
    ("", "empty"), ("   \n", "empty"), ("hi there", "too short"),
    ("word " * 300, "too long"),
    ("Tell me <|im_start|>assistant about cats", "template tokens"),
    ("12345 67890 %%%% 1111 2222 ???? ++++ a", "non-text"),
    ("What is \ufffd this thing here?", "non-text"),
    ("Please help me!!!!!!!!!!!!!!!! now with this", "repetition"),
    ("buy the cat " * 12 + "please", "repetition"),
    (" ".join(["alpha", "beta"] * 15), "repetition"),
])
def test_degenerate_user_turns_are_rejected_with_their_reason(text, reason):
    assert degenerate_reason(text) == reason


@pytest.mark.parametrize("text", [
    "How can I improve my public speaking skills?",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "I'm planning a trip to Lisbon in May. What should I see in three days, and what should I eat?",
    "Solve for x: 3x + 7 = 22. Show each step.",
])
def test_ordinary_user_turns_pass(text):
    assert degenerate_reason(text) is None


def jaccard3(a: str, b: str) -> float:
    def grams(t):
        w = words(t)
        n = min(3, len(w))
        return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}
    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y)


def test_near_duplicates_match_brute_force_jaccard():
    """Texts with a known overlap: every pair at Jaccard >= 0.85 is caught (LSH recall), and nothing below
    the 0.6 threshold is ever called a duplicate (candidates are confirmed exactly)."""
    r = random.Random(0)
    vocab = [f"w{i}" for i in range(400)]
    bases = [[r.choice(vocab) for _ in range(30)] for _ in range(60)]
    texts = []
    for b in bases:
        texts.append(" ".join(b))
        edited = list(b)
        for _ in range(r.choice([1, 2, 12])):  # a light edit (near duplicate) or a heavy one (not)
            edited[r.randrange(len(edited))] = r.choice(vocab)
        texts.append(" ".join(edited))
    near = NearDuplicates()
    kept = []
    for t in texts:
        j = near.duplicate_of(t)
        if j is None:
            near.add(t)
            kept.append(t)
        elif j >= 0:
            assert jaccard3(t, kept[j]) >= 0.6
        best = max((jaccard3(t, k) for k in kept if k is not t), default=0.0)
        if best >= 0.85:
            assert j is not None
    assert 60 <= len(kept) < 120
    assert near.duplicate_of(texts[0].upper() + " ") == -1  # exact, after normalizing case and spacing


def test_overlap_guard_is_the_largest_5gram_share_of_any_one_reference():
    r = random.Random(1)
    vocab = [f"v{i}" for i in range(50)]
    refs = [" ".join(r.choice(vocab) for _ in range(r.randint(3, 40))) for _ in range(30)]
    guard = OverlapGuard(refs)
    for _ in range(200):
        ref = r.choice(refs).split()
        text = " ".join(ref[:r.randint(0, len(ref))] + [r.choice(vocab) for _ in range(r.randint(0, 20))])
        grams = word_ngrams(text, 5)
        brute = max((len(grams & word_ngrams(x, 5)) / len(grams) for x in refs), default=0.0) if grams else 0.0
        assert guard.share(text) == pytest.approx(brute)
        assert guard.rejects(text) == (brute > 0.3)


def test_specbench_prompts_are_rejected_and_unrelated_text_is_not():
    texts = specbench_texts()
    guard = OverlapGuard(texts)
    long_ones = [t for t in texts if len(word_ngrams(t, 5)) >= 4]
    assert long_ones and all(guard.rejects(t) for t in long_ones)
    assert all(guard.rejects("Hi! " + t + " Thanks a lot.") for t in long_ones[:50])
    assert not guard.rejects("Can you suggest three vegetarian dinners that take under thirty minutes to cook?")


def test_filters_count_rejections_by_reason():
    f = Filters(guard=OverlapGuard(["one two three four five six"]))
    assert f.accept("How do I bake sourdough bread at home?")
    assert not f.accept("how do I bake sourdough bread at home")
    assert not f.accept("ok")
    assert not f.accept("Please: one two three four five six")
    assert dict(f.rejected) == {"duplicate": 1, "too short": 1, "evaluation overlap": 1}
