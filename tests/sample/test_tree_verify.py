"""Verifying draft trees (sample/tree_verify.py): greedy walks the argmax path, sampling keeps the target's
distribution with several candidates per node (recursive rejection), seeded requests emit their own draws."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.sample.keyed import keyed_uniforms, tree_levels
from specserve.sample.metadata import SamplingMetadata
from specserve.sample.sampler import compute_probs, tree_sample
from specserve.sample.tree_verify import verify_tree_argmax, verify_tree_random
from specserve.sampling_params import SamplingParams
from specserve.sample.draft_tree import DraftTree
from tests.spec_decode.test_spec_sampling_e2e import chi_square_p_value

VOCAB = 6
# root children 0, 1, 2; node 0 (token 0) has children 3, 4; node 3 (token 3) a child 5
TREE = DraftTree.from_paths([[0, 3, 5], [0, 4], [1], [2]])


def meta(params, outputs=((),), seeds=(None,)):
    return SamplingMetadata.build([params] * len(outputs), [list(o) for o in outputs], [[9]] * len(outputs),
                                  list(seeds), set(), VOCAB)


def test_greedy_takes_the_longest_path_of_argmaxes():
    # rows: root, then nodes 0..6 (tokens 0, 3, 5, 4, 1, 2); argmax per row
    targets = torch.tensor([0, 3, 1, 2, 2, 2, 2])
    out = verify_tree_argmax([TREE], targets)
    assert out.accepted == [[0, 1]] and out.token_ids == [[0, 3, 1]]  # node 1 (token 3) wants 1: not a child
    out = verify_tree_argmax([TREE], torch.tensor([2, 3, 1, 2, 2, 2, 4]))
    assert out.accepted == [[5]] and out.token_ids == [[2, 4]]
    out = verify_tree_argmax([TREE, DraftTree.chain([7, 8])], torch.tensor([5, 0, 0, 0, 0, 0, 0, 7, 8, 9]))
    assert out.token_ids == [[5], [7, 8, 9]] and out.accepted == [[], [0, 1]]


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)],
                         ids=["temperature", "top_k_top_p"])
def test_sampling_over_sibling_candidates_keeps_the_target_distribution(sampling):
    """The first two emitted tokens' joint law is p_root(t1) * p_node(t1)(t2), whichever children the tree
    offers; the same counts reject a hotter target."""
    torch.manual_seed(0)
    logits_by_path = {(): torch.randn(VOCAB) * 1.5}
    for t in range(VOCAB):
        logits_by_path[(t,)] = torch.randn(VOCAB) * 1.5
    rows = [logits_by_path[()]] + [logits_by_path.get(tuple(TREE.tokens[v] for v in TREE.path_to(n))[:1],
                                                      torch.randn(VOCAB)) for n in range(len(TREE))]
    # rows of depth-2+ nodes only matter after two accepted tokens, past what is counted
    logits = torch.stack(rows)
    params = SamplingParams(**sampling)
    counts = np.zeros(VOCAB * VOCAB)
    n = 20000
    for _ in range(n):
        out = verify_tree_random([TREE], logits, meta(params))
        toks = out.token_ids[0]
        if len(toks) == 1:  # no child accepted: the second token would come from the next step's p(t1)
            second = int(torch.multinomial(compute_probs(logits_by_path[(toks[0],)][None], meta(params))[0], 1))
            toks = toks + [second]
        counts[toks[0] * VOCAB + toks[1]] += 1

    def joint(p):
        first = compute_probs(logits_by_path[()][None], meta(p))[0].double().numpy()
        seconds = np.stack([compute_probs(logits_by_path[(t,)][None], meta(p))[0].double().numpy()
                            for t in range(VOCAB)])
        return (first[:, None] * seconds).ravel()

    assert chi_square_p_value(counts, joint(params)) > 1e-4
    hotter = SamplingParams(**{**sampling, "temperature": sampling["temperature"] * 1.25})
    assert chi_square_p_value(counts, joint(hotter)) < 1e-4


def test_a_seeded_request_emits_its_own_draws_along_the_tree():
    """Coupling: at each node the keyed draw at that output position; a child holding it is accepted."""
    torch.manual_seed(1)
    logits = torch.randn(1 + len(TREE), VOCAB) * 2
    params = SamplingParams(temperature=1.0, seed=3)
    output = [4, 4]
    out = verify_tree_random([TREE], logits, meta(params, [output], [3]))
    node, expected = -1, []
    while True:  # walk as plain decoding would draw
        history = output + expected
        row = 1 + node
        p = compute_probs(logits[row][None], meta(params, [history], [3]))
        u = torch.tensor([keyed_uniforms(3, len(history), tree_levels(VOCAB))], dtype=torch.float64)
        t = int(tree_sample(p.double().cumsum(-1), u)[0])
        expected.append(t)
        child = TREE.children[node].get(t)
        if child is None:
            break
        node = child
    assert out.token_ids == [expected] and len(expected) >= 2  # a child was accepted
