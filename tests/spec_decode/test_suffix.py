"""Suffix decoding: the trie's counts against brute-force substring counts, and the proposer's drafts."""
import random
from collections import Counter

import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.proposer import DraftInputs
from specserve.spec_decode.suffix import SuffixProposer, SuffixTrie, _Node
from specserve.spec_decode.tree import parse_token_tree
from tests.tiny_models import save_hf_folder, tiny_hf_model


def make_inputs(req_ids, token_ids, num_drafts, num_prompt=None, max_model_len=1 << 20, finished=()):
    empty = torch.zeros(0, dtype=torch.long)
    return DraftInputs(
        req_ids=list(req_ids), sampled_token_ids=[[t[-1]] for t in token_ids],
        next_token_ids=[t[-1] for t in token_ids], token_ids=token_ids,
        num_prompt_tokens=list(num_prompt or [1] * len(req_ids)), num_drafts=list(num_drafts),
        target_token_ids=empty, target_positions=empty, target_hidden_states=torch.zeros(0, 1),
        aux_hidden_states=None, cu_num_tokens=[0] * (len(req_ids) + 1), sampling_params=[None] * len(req_ids),
        seeds=[None] * len(req_ids), max_model_len=max_model_len, finished_req_ids=set(finished))


def proposer(k=8, depth=24, cached=1000, factor=1.0, min_prob=0.1):
    return SuffixProposer(SpeculativeConfig(
        method="suffix", num_speculative_tokens=k, suffix_decoding_max_tree_depth=depth,
        suffix_decoding_max_cached_requests=cached, suffix_decoding_max_spec_factor=factor,
        suffix_decoding_min_token_prob=min_prob))


def one(p, req_id, history, k=8, num_prompt=1, **kw):
    return p.propose(make_inputs([req_id], [history], [k], [num_prompt], **kw)).token_ids[0]


def trie_counts(trie):
    """Every substring the trie represents, with its count (leaves expanded along their sequence)."""
    out = Counter()

    def walk(node, path):
        for tok, child in node.children.items():
            sub = path + (tok,)
            if type(child) is _Node:
                assert child.total == sum(c.count if type(c) is _Node else 1 for c in child.children.values())
                out[sub] += child.count
                walk(child, sub)
            else:
                seq_id, start = child
                seq = trie.seqs[seq_id]
                for end in range(len(sub), min(trie.depth, len(seq) - start) + 1):
                    out[tuple(seq[start:start + end])] += 1

    walk(trie.root, ())
    return out


def substring_counts(seqs, depth):
    return Counter(tuple(s[i:j]) for s in seqs for i in range(len(s)) for j in range(i + 1, min(i + depth, len(s)) + 1))


# ---- the trie --------------------------------------------------------------------------------
def test_trie_counts_match_brute_force_through_appends_and_removals():
    rng, seq_id = random.Random(0), 0
    for _ in range(500):
        depth = rng.randint(1, 6)
        trie, seqs = SuffixTrie(depth), {}
        for _ in range(rng.randint(1, 8)):
            if seqs and rng.random() < 0.35:
                victim = rng.choice(list(seqs))
                trie.remove(victim)
                del seqs[victim]
            else:
                seq_id += 1
                tokens = [rng.randrange(3) for _ in range(rng.randint(0, 15))]
                for i in range(0, max(len(tokens), 1), 3):  # a few at a time, as decoding appends
                    trie.extend(seq_id, tokens[i:i + 3])
                seqs[seq_id] = tokens
            assert trie_counts(trie) == substring_counts(seqs.values(), depth)
        for victim in list(seqs):
            trie.remove(victim)
        assert trie.root.children == {} and trie.root.total == 0  # nothing left behind


def test_only_the_latest_sequence_grows():
    trie = SuffixTrie(4)
    trie.extend(1, [1, 2])
    trie.extend(2, [3])
    with pytest.raises(ValueError, match="closed"):
        trie.extend(1, [4])


def test_greedy_draft_follows_counts_and_prunes_by_path_probability():
    trie = SuffixTrie(8)
    trie.extend(0, [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9])
    node = trie.match([1, 2])  # continuations: 3, 3, 4
    # path probabilities 2/3 2/3 2/3 2/3, then "1 2 3 9 1 2" went on with 3 once and 4 once (latest wins)
    assert trie.draft(node, 2, 8, 0.1) == ([3, 9, 1, 2, 4, 9], pytest.approx(4 * 2 / 3 + 2 * 1 / 3))
    assert trie.draft(node, 2, 8, 0.5)[0] == [3, 9, 1, 2]  # then 1/3 < 0.5
    assert trie.draft(node, 2, 8, 0.7) == ([], 0.0)
    assert trie.draft(node, 2, 3, 0.1)[0] == [3, 9, 1]  # the limit
    # "9 1 2 3" occurred once (a leaf): its continuation, up to substring length 8
    assert trie.draft(trie.match([9, 1, 2, 3]), 4, 8, 0.1) == ([9, 1, 2, 4], 4.0)
    deep = SuffixTrie(12)
    deep.extend(0, [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9])
    assert deep.draft(deep.match([9, 1, 2, 3]), 4, 8, 0.1)[0] == [9, 1, 2, 4, 9]  # the sequence ends


# ---- the proposer ----------------------------------------------------------------------------
def test_repetitive_text_gets_long_drafts():
    p = proposer(k=8)
    unit = list(range(100, 112))
    history = unit * 4 + unit[:5]
    assert one(p, "r", history) == unit[5:12] + unit[:1]
    history += unit[5:9]
    assert one(p, "r", history) == unit[9:12] + unit[:5]


def test_global_trie_drafts_for_a_new_request_repeating_an_earlier_output():
    p = proposer(k=6)
    prompt_a, output = [1, 2, 3], list(range(200, 230))
    one(p, "a", prompt_a + output, num_prompt=3)
    p.propose(make_inputs([], [], [], finished={"a"}))
    assert p.global_trie.seqs == {0: output}  # the output only, not the prompt
    history = [7, 8, 9] + output[:6]  # a 6-token match allows 6 drafts (factor 1)
    assert one(p, "b", history, k=6, num_prompt=3) == output[6:12]
    assert one(proposer(k=6), "b", history, num_prompt=3) == []  # its own tokens alone: no match


def test_eviction_forgets_the_oldest_request():
    p = proposer(k=4, cached=1)
    out_a, out_c = list(range(300, 320)), list(range(400, 420))
    for req_id, output in [("a", out_a), ("c", out_c)]:
        one(p, req_id, [1] + output)
        p.propose(make_inputs([], [], [], finished={req_id}))
    assert list(p.global_trie.seqs.values()) == [out_c]
    assert trie_counts(p.global_trie) == substring_counts([out_c], 24)  # a's counts are gone
    assert one(p, "b", [5] + out_a[:6]) == []
    assert one(p, "d", [5] + out_c[:6]) == out_c[6:10]


def test_drafts_respect_num_drafts():
    """num_drafts arrives already capped to fit max_model_len (the runner's max_draft_tokens)."""
    p = proposer(k=8)
    history = list(range(10)) * 3 + [0, 1]  # 32 tokens; the next ones are 2 3 4 ...
    out = p.propose(make_inputs(["a", "b", "c"], [history, list(history), list(history)], [8, 3, 0]))
    assert out.token_ids == [[2, 3, 4, 5, 6, 7, 8, 9], [2, 3, 4], []] and out.probs is None
    for k, want in [(8, 8), (7, 7), (1, 1), (0, 0)]:
        assert len(one(p, "a", history, k=k)) == want


def test_min_token_prob_prunes_low_probability_branches():
    # after "9 1 2": 3 once, 4 once (1/2 each); after "1 2": 3 twice, 4 once (2/3 for 3)
    history = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 2]
    assert one(proposer(min_prob=0.1), "r", history) == [4, 9, 1]  # score 3 * 1/2 beats 2 * 2/3
    assert one(proposer(min_prob=0.6), "r", history) == [3, 9]  # the 1/2 branch is pruned
    assert one(proposer(min_prob=0.7), "r", history) == []


def test_trees_hold_the_most_probable_continuations_sized_by_step_cost():
    """draft_tree="auto": the best match's continuations as a tree, most probable nodes first (within the
    depth cap and min_token_prob), its first path the best chain, as many nodes as pay at the given costs."""
    history = [1, 2, 3, 7] * 3 + [1, 2, 4, 7, 1, 2]  # after "7 1 2": 3 twice, 4 once; then 7, 1
    p = proposer(k=3, min_prob=0.1)

    def tree_of(per_row_cost, max_nodes=16):
        inputs = make_inputs(["r"], [history], [3])
        inputs.tree_costs = lambda option, n: [1.0 + per_row_cost * k for k in range(n + 1)]
        inputs.max_tree_nodes = max_nodes
        out = p.propose(inputs)
        return out.token_ids[0], out.trees[0] if out.trees else None

    tokens, tree = tree_of(0.01)
    # nodes by path probability: 3, 3-7, 3-7-1 (2/3 each), then 4, 4-7, 4-7-1 (1/3); the likelier path first
    assert tree.tokens == (3, 7, 1, 4, 7, 1) and tree.parents == (-1, 0, 1, -1, 3, 4)
    assert tokens == list(tree.tokens)
    assert tree_of(0.01, max_nodes=4)[1].tokens == (3, 7, 1, 4)
    # a row at 30% of a step: the 1/3 branch does not pay for its rows; the best chain is drafted
    tokens, tree = tree_of(0.3)
    assert tree is None and tokens == [3, 7, 1]
    # a static shape (vLLM's speculative_token_tree): children by rank, the likeliest first
    inputs = make_inputs(["r"], [history], [3])
    inputs.tree_costs, inputs.max_tree_nodes = (lambda option, n: [1.0] * (n + 1)), 4
    inputs.tree_shape = parse_token_tree("[(0,), (1,), (0, 0), (2,), (1, 0), (1, 0, 0), (1, 0, 0, 0)]")
    tree = p.propose(inputs).trees[0]
    # ranks (2,) does not exist (two children), (1, 0, 0, 0) is deeper than num_drafts
    assert tree.tokens == (3, 7, 4, 7, 1) and tree.parents == (-1, 0, -1, 2, 3)
    # a request whose SamplingParams ask for chains gets the chain
    inputs = make_inputs(["r"], [history], [3])
    inputs.tree_costs, inputs.max_tree_nodes = (lambda option, n: [1.0] * (n + 1)), 16
    inputs.sampling_params = [SamplingParams(draft_tree="chain")]
    out = p.propose(inputs)
    assert out.trees is None and out.token_ids == [[3, 7, 1]]


def test_draft_length_grows_with_match_length():
    unit = list(range(100, 130))
    for match_len in range(1, 13):
        history = unit + [99] + unit[:match_len]  # the longest earlier match is exactly match_len long
        got = one(proposer(k=8, factor=0.5), "r", history)
        assert got == unit[match_len:match_len + min(8, -(-match_len // 2))]


def test_preempted_requests_keep_drafting_and_greedy_output_stays_plain_decodings(tmp_path):
    """Through the engine, with a KV cache small enough that requests are preempted and recomputed: a
    preempted request keeps its trie and resumes drafting from it, each finished request's output joins
    the global trie once, and the tokens are plain decoding's."""
    model = save_hf_folder(tiny_hf_model("llama"), tmp_path / "tiny")
    engine = dict(model=model, max_model_len=128, block_size=4, num_kv_blocks=40, max_num_seqs=12)
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, 160, (n,), generator=g).tolist()} for n in range(4, 28, 2)]
    params = [SamplingParams(temperature=0.0, max_tokens=24 + 8 * (i % 3), ignore_eos=True)
              for i in range(len(prompts))]
    plain = LLM(**engine)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(**engine, speculative_config={"method": "suffix", "num_speculative_tokens": 4,
                                             "adaptive_draft_length": False})
    proposer = spec.llm_engine.runner.proposer
    retired = []
    retire = proposer._retire
    proposer._retire = lambda req_id: (retired.append(req_id), retire(req_id))[1]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    m = spec.get_metrics()
    assert m.num_preemptions > 0 and m.num_accepted_tokens > 0
    assert retired and len(retired) == len(set(retired))  # preemption never retires a request
