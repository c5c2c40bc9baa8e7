"""Filters for synthesized user turns: degenerate text, exact and near duplicates (MinHash over word 3-grams,
confirmed on the sets), and overlap with the evaluation set (Spec-Bench) by word 5-grams."""
from __future__ import annotations

import re
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

SPECIAL_TEXT = re.compile(r"<\|[^|>]*\|>|</?s>|\[INST\]|<start_of_turn>|<end_of_turn>")
WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def degenerate_reason(text: str, min_words: int = 3, max_words: int = 250, max_chars: int = 1600) -> str | None:
    """Why a synthesized user turn is unusable, or None: empty or out of length bounds, chat-template
    tokens, non-text (few letters, control or replacement characters), or degenerate repetition (a character
    run, few distinct words, one word 3-gram repeated over a fifth of the text)."""
    w = words(text)
    if not w:
        return "empty"
    if len(w) < min_words:
        return "too short"
    if len(w) > max_words or len(text) > max_chars:
        return "too long"
    if SPECIAL_TEXT.search(text):
        return "template tokens"
    visible = [c for c in text if not c.isspace()]
    if "\ufffd" in text or any(ord(c) < 32 and c not in "\n\t\r" for c in text):
        return "non-text"
    if re.search(r"(\S)\1{11,}", text):
        return "repetition"
    if sum(c.isalpha() for c in visible) < 0.6 * len(visible):
        return "non-text"
    if len(w) >= 20 and len(set(w)) < 0.35 * len(w):
        return "repetition"
    grams = Counter(tuple(w[i:i + 3]) for i in range(len(w) - 2))
    if grams:
        count = grams.most_common(1)[0][1]
        if count >= 4 and 3 * count > 0.2 * len(w):
            return "repetition"
    return None


_PRIME = (1 << 61) - 1


def _shingle_hashes(grams: Iterable[tuple[str, ...]]) -> np.ndarray:
    return np.array([zlib.crc32(" ".join(g).encode()) for g in grams], dtype=np.uint64)


class NearDuplicates:
    """Exact and near-duplicate detection over many short texts: a text is a near duplicate of an earlier
    one when the Jaccard similarity of their word 3-gram sets (word sets under 3 words) is at least
    `threshold`. Candidates come from MinHash signatures in LSH bands and are confirmed on the sets."""

    def __init__(self, threshold: float = 0.6, num_perm: int = 64, bands: int = 16, n: int = 3, seed: int = 0) -> None:
        if num_perm % bands:
            raise ValueError(f"num_perm {num_perm} must be a multiple of bands {bands}")
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, 1 << 31, num_perm, dtype=np.uint64)
        self.b = rng.integers(0, 1 << 31, num_perm, dtype=np.uint64)
        self.threshold, self.bands, self.n = threshold, bands, n
        self.rows = num_perm // bands
        self.exact: set[str] = set()
        self.sets: list[frozenset] = []
        self.buckets: list[dict[bytes, list[int]]] = [{} for _ in range(bands)]

    def _shingles(self, text: str) -> frozenset:
        w = words(text)
        n = min(self.n, len(w))
        return frozenset(tuple(w[i:i + n]) for i in range(len(w) - n + 1)) if w else frozenset()

    def _signature(self, shingles: frozenset) -> np.ndarray:
        h = _shingle_hashes(shingles)[:, None]
        # (a * h + b) mod p with a, h < 2^32: exact in uint64, no overflow
        return ((self.a[None, :] * h + self.b[None, :]) % np.uint64(_PRIME)).min(0)

    def duplicate_of(self, text: str) -> int | None:
        """Index of an earlier text this one duplicates (exactly: -1), or None."""
        key = " ".join(words(text))
        if key in self.exact:
            return -1
        shingles = self._shingles(text)
        if not shingles:
            return None
        sig = self._signature(shingles)
        seen = set()
        for band, table in enumerate(self.buckets):
            for j in table.get(sig[band * self.rows:(band + 1) * self.rows].tobytes(), ()):
                if j not in seen:
                    seen.add(j)
                    other = self.sets[j]
                    if len(shingles & other) >= self.threshold * len(shingles | other):
                        return j
        return None

    def add(self, text: str) -> bool:
        """Adds text unless it duplicates an earlier one; True if added."""
        if self.duplicate_of(text) is not None:
            return False
        self.exact.add(" ".join(words(text)))
        shingles = self._shingles(text)
        index = len(self.sets)
        self.sets.append(shingles)
        if shingles:
            sig = self._signature(shingles)
            for band, table in enumerate(self.buckets):
                table.setdefault(sig[band * self.rows:(band + 1) * self.rows].tobytes(), []).append(index)
        return True


class OverlapGuard:
    """Keeps evaluation text out: share(text) is the largest fraction of text's word 5-grams that any one
    reference contains; texts above max_share are rejected."""

    def __init__(self, references: Sequence[str], n: int = 5, max_share: float = 0.3) -> None:
        self.n, self.max_share = n, max_share
        self.index: dict[tuple[str, ...], list[int]] = {}
        for i, ref in enumerate(references):
            for g in word_ngrams(ref, n):
                self.index.setdefault(g, []).append(i)

    def share(self, text: str) -> float:
        grams = word_ngrams(text, self.n)
        if not grams:
            return 0.0
        hits = Counter(i for g in grams for i in self.index.get(g, ()))
        return max(hits.values(), default=0) / len(grams)

    def rejects(self, text: str) -> bool:
        return self.share(text) > self.max_share


def specbench_texts(path: str | None = None) -> list[str]:
    """Every turn of every Spec-Bench question (the benchmarks' dataset)."""
    from specserve.bench.common import DEFAULT_DATASET, read_specbench

    return [t for row in read_specbench(path or DEFAULT_DATASET) for t in row["turns"] if isinstance(t, str)]


@dataclass
class Filters:
    """The user-turn filter chain, with rejection counts by reason."""

    near: NearDuplicates = field(default_factory=NearDuplicates)
    guard: OverlapGuard | None = None
    rejected: Counter = field(default_factory=Counter)
    passages_used: set[str] = field(default_factory=set)  # passage_key of each document requests were about

    def reason(self, text: str, max_words: int = 250, max_chars: int = 1600) -> str | None:
        why = degenerate_reason(text, max_words=max_words, max_chars=max_chars)
        if why is None and self.guard is not None and self.guard.rejects(text):
            why = "evaluation overlap"
        if why is None and self.near.duplicate_of(text) is not None:
            why = "duplicate"
        return why

    def accept(self, text: str, max_words: int = 250, max_chars: int = 1600) -> bool:
        why = self.reason(text, max_words, max_chars)
        if why is not None:
            self.rejected[why] += 1
            return False
        self.near.add(text)
        return True
