"""Prompt-lookup drafting: exact drafts on hand-built histories, and the numpy search against a plain loop."""
import random

import numpy as np
import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.spec_decode.ngram import ONE_TOKEN_MATCH_MAX_DRAFTS, NgramProposer, find_ngram_draft, find_ngram_match
from specserve.spec_decode.proposer import DraftInputs
from specserve.ops import kernels
from tests.kernel_support import requires_c_kernels


def make_inputs(req_ids, token_ids, num_drafts, max_model_len=1 << 20, finished=()):
    empty = torch.zeros(0, dtype=torch.long)
    return DraftInputs(
        req_ids=list(req_ids), sampled_token_ids=[[t[-1]] for t in token_ids],
        next_token_ids=[t[-1] for t in token_ids], token_ids=token_ids,
        num_prompt_tokens=[1] * len(req_ids), num_drafts=list(num_drafts), target_token_ids=empty,
        target_positions=empty, target_hidden_states=torch.zeros(0, 1), aux_hidden_states=None,
        cu_num_tokens=[0] * (len(req_ids) + 1), sampling_params=[None] * len(req_ids),
        seeds=[None] * len(req_ids), max_model_len=max_model_len, finished_req_ids=set(finished))


def proposer(k=4, lo=2, hi=5):
    return NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=k,
                                           prompt_lookup_min=lo, prompt_lookup_max=hi))


def draft(tokens, lo=2, hi=5, k=4, prefer_end=-1):
    return find_ngram_draft(np.array(tokens), lo, hi, k, prefer_end).tolist()


def reference_draft(tokens, lo, hi, k, prefer_end=-1):
    """Plain loops: longest n first; the preferred occurrence, else the latest; periodic continuation."""
    size = len(tokens)
    for n in range(min(hi, size - 1), lo - 1, -1):
        ends = [j for j in range(n - 1, size - 1) if tokens[j - n + 1:j + 1] == tokens[size - n:]]
        if ends:
            end = prefer_end if prefer_end in ends else ends[-1]
            period = size - 1 - end
            return [tokens[end + 1 + i % period] for i in range(k)]
    return []


# ---- the search ------------------------------------------------------------------------------
def test_longest_match_beats_a_more_recent_shorter_one():
    #        [1 2 3]->4 ...      [2 3]->7 (more recent, but only 2 long)   suffix 1 2 3
    tokens = [1, 2, 3, 4, 5, 6, 9, 2, 3, 7, 8, 1, 2, 3]
    assert draft(tokens, 2, 3) == [4, 5, 6, 9]
    assert draft(tokens, 2, 2) == [7, 8, 1, 2]  # capped at 2: the latest 2-gram wins


def test_most_recent_of_equally_long_matches():
    tokens = [1, 2, 10, 11, 1, 2, 20, 21, 22, 23, 1, 2]
    assert draft(tokens, 2, 4) == [20, 21, 22, 23]
    assert draft(tokens, 2, 4, prefer_end=1) == [10, 11, 1, 2]  # the source we were copying from


def test_no_match_and_min_n():
    assert draft([1, 2, 3, 4, 5]) == []
    assert draft([1, 9, 8, 1]) == []  # only a 1-gram matches; min_n = 2
    assert draft([1, 9, 8, 1], lo=1) == [9, 8, 1, 9]
    assert draft([5], lo=1) == [] and draft([], lo=1) == []


def test_k_cap_and_periodic_continuation():
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert draft(tokens, k=2) == [3, 4]
    assert draft(tokens, k=0) == []
    assert draft([7, 7, 7, 7], k=3) == [7, 7, 7]  # period 1: the draft keeps copying itself
    assert draft([1, 2, 1, 2, 1], k=5) == [2, 1, 2, 1, 2]


def test_matches_reference_on_random_sequences():
    rng = random.Random(0)
    for _ in range(3000):
        size, alphabet = rng.randint(0, 40), rng.randint(1, 4)
        tokens = [rng.randrange(alphabet) for _ in range(size)]
        lo = rng.randint(1, 4)
        hi, k = rng.randint(lo, 6), rng.randint(0, 6)
        hint = rng.randint(-1, size)
        assert draft(tokens, lo, hi, k, hint) == reference_draft(tokens, lo, hi, k, hint), (tokens, lo, hi, k)


def test_int32_input_and_match_index():
    tokens = np.array([3, 1, 2, 3, 1, 2], dtype=np.int32)
    assert find_ngram_match(tokens, 2, 3) == 2
    assert find_ngram_draft(tokens, 2, 3, 2).tolist() == [3, 1]


@requires_c_kernels
def test_c_search_matches_numpy_on_random_sequences():
    rng = random.Random(1)
    for _ in range(3000):
        size, alphabet = rng.randint(0, 60), rng.randint(1, 4)
        tokens = np.array([rng.randrange(alphabet) for _ in range(size)], dtype=np.int64)
        lo = rng.randint(1, 4)
        hi, hint = rng.randint(lo, 8), rng.randint(-2, size + 1)
        assert kernels.ngram_match(tokens, lo, hi, hint) == find_ngram_match(tokens, lo, hi, hint), (
            tokens.tolist(), lo, hi, hint)


@requires_c_kernels
def test_c_search_refuses_other_dtypes_and_strided_views():
    with pytest.raises(ValueError, match="int64"):
        kernels.ngram_match(np.array([1, 2, 1], dtype=np.int32), 1, 2)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.ngram_match(np.arange(10, dtype=np.int64)[::2], 1, 2)


def test_proposer_uses_numpy_when_the_kernels_are_off(monkeypatch):
    monkeypatch.setenv("SPECSERVE_KERNELS", "torch")
    assert proposer()._find_match is find_ngram_match


# ---- the proposer ----------------------------------------------------------------------------
def test_config_refuses_min_above_max():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=4, prompt_lookup_max=2)


def test_proposer_caps_by_num_drafts():
    """num_drafts arrives already capped to fit max_model_len (the runner's max_draft_tokens)."""
    p = proposer(k=4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]  # 9 tokens; the match predicts 3 4 5 6
    out = p.propose(make_inputs(["a", "b", "c"], [tokens, list(tokens), list(tokens)], [4, 2, 0]))
    assert out.token_ids == [[3, 4, 5, 6], [3, 4], []] and out.probs is None
    assert p.propose(make_inputs(["a"], [tokens], [9])).token_ids == [[3, 4, 5, 6]]  # k caps too


def test_proposer_drafts_less_after_a_one_token_match():
    p = proposer(k=6, lo=1, hi=3)
    one = [7, 1, 2, 3, 4, 5, 6, 8, 9, 1]  # only "1" recurs: at most ONE_TOKEN_MATCH_MAX_DRAFTS
    two = [7, 1, 2, 3, 4, 5, 6, 8, 7, 1]  # "7 1" recurs: the full k
    out = p.propose(make_inputs(["a", "b"], [one, two], [6, 6])).token_ids
    continuation = [2, 3, 4, 5, 6, 8]  # what followed the match in both
    assert out == [continuation[:ONE_TOKEN_MATCH_MAX_DRAFTS], continuation] and len(out[0]) < len(out[1])
    assert p.propose(make_inputs(["c"], [one], [2])).token_ids == [[2, 3]]  # a smaller k still applies


def test_proposer_keeps_copying_from_the_same_source():
    prompt = [10, 11, 12, 13, 50, 11, 12, 14, 51]  # "11 12" is followed by 13, later by 14
    p = proposer(k=4, lo=1, hi=2)
    assert p.propose(make_inputs(["r"], [prompt + [10, 11]], [4])).token_ids == [[12, 13, 50, 11]]
    history = prompt + [10, 11, 12]  # the output is copying the first region
    assert p.propose(make_inputs(["r"], [history], [4])).token_ids == [[13, 50, 11, 12]]
    assert proposer(k=4, lo=1, hi=2).propose(make_inputs(["r"], [history], [4])).token_ids == [[14, 51, 10, 11]]


def test_incremental_cache_equals_fresh_computation():
    rng = random.Random(1)
    p = proposer(k=3, lo=1, hi=4)
    history = [rng.randrange(3) for _ in range(5)]
    prev_end = prev_size = -1
    for _ in range(200):  # grows the buffer several times
        history.extend(rng.randrange(3) for _ in range(rng.randint(1, 4)))
        got = p.propose(make_inputs(["r"], [history], [3])).token_ids[0]
        fresh = np.array(history)
        # the source hint: last step's match end, advanced by the tokens appended since
        hint = prev_end + len(history) - prev_size if prev_end >= 0 else -1
        assert got == find_ngram_draft(fresh, 1, 4, 3, hint).tolist()
        assert np.array_equal(p._histories["r"].buf[:len(history)], fresh)
        assert p._histories["r"].address == p._histories["r"].buf.ctypes.data  # where the C search reads
        prev_end, prev_size = find_ngram_match(fresh, 1, 4, hint), len(history)


def test_reused_id_rebuilds_and_finished_frees():
    p = proposer()
    p.propose(make_inputs(["r"], [[1, 2, 3, 1, 2]], [4]))
    assert p.propose(make_inputs(["r"], [[9, 8, 9]], [4])).token_ids == [[]]  # shorter: rebuilt
    assert p.propose(make_inputs(["r"], [[5, 8, 5, 8]], [4])).token_ids == [[5, 8, 5, 8]]  # same length, new tokens
    p.propose(make_inputs([], [], [], finished={"r"}))
    assert p._histories == {}


def test_trees_hold_the_continuations_of_the_latest_occurrences():
    """draft_tree: what followed each of the matched n-gram's latest occurrences, shared prefixes merged, a
    node at the share of occurrences through it; the likeliest (ties: the latest) path first."""
    # "1 2" occurs three times before the end: followed by 3 4, 3 5, 6 7
    history = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 6, 7, 9, 1, 2]
    inputs = make_inputs(["r"], [history], [2])
    inputs.tree_costs, inputs.max_tree_nodes = (lambda option, n: [1.0 + 0.01 * k for k in range(n + 1)]), 16
    out = proposer(k=2, lo=2, hi=2).propose(inputs)
    tree = out.trees[0]
    assert out.token_ids[0] == list(tree.tokens)
    assert {tuple(tree.tokens[v] for v in tree.path_to(leaf)) for leaf in tree.leaves} == {(3, 5), (3, 4), (6, 7)}
    assert tree.tokens[:2] == (3, 5)  # 3 (2 of 3), then the latest after it
    # one occurrence: a chain, as without trees
    inputs = make_inputs(["s"], [[1, 2, 3, 4, 9, 1, 2]], [2])
    inputs.tree_costs, inputs.max_tree_nodes = (lambda option, n: [1.0] * (n + 1)), 16
    out = proposer(k=2, lo=2, hi=2).propose(inputs)
    assert out.trees is None and out.token_ids == [[3, 4]]
